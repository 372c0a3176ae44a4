#!/usr/bin/python3
"""Reports C++ function definitions longer than N lines.

  /usr/bin/python3 tests/lint/function_length.py [--max 120] PATH...

Each PATH is a .cc file or a folder searched recursively for .cc files (folders named
bazel-* and hidden ones are skipped). Every function definition (free functions, methods,
constructors, operators, and test bodies such as TEST(...) { ... }) whose span from the line of
its name to its closing brace is longer than --max lines is printed as

  path:line name length

in path and line order. Exit status: 1 if any was reported, 0 if none, 2 on a usage error.

The scan is a brace matcher, not a parser: it removes comments, string and character
literals (raw strings included) and preprocessor lines, then finds `{` at namespace or class
scope whose preceding text looks like a function head (a parameter list, optionally
followed by qualifiers, a trailing return type or a constructor's initializer list). Lambdas
and blocks inside a function count towards that function. Python 3 standard library only.
"""

import argparse
import os
import re
import sys

_CONTROL = {"if", "for", "while", "switch", "catch", "do", "else", "try", "return"}
_RECORD = re.compile(r"\b(class|struct|union)\b")
_ENUM = re.compile(r"\benum\b")
_NAMESPACE = re.compile(r"\bnamespace\b|\bextern\s*$")
_IDENT_END = re.compile(r"[A-Za-z0-9_>\]]\s*$")


def strip_code(text):
    """Returns `text` with comments, literals and preprocessor lines blanked out.

    Newlines are kept (line numbers stay valid); every removed character becomes a space, and
    a string or character literal becomes empty quotes, so braces inside them are not seen.
    """
    out = []
    i, n = 0, len(text)
    at_line_start = True
    while i < n:
        c = text[i]
        if at_line_start and c in " \t":
            out.append(c)
            i += 1
            continue
        if at_line_start and c == "#":
            # Preprocessor directive, with backslash continuations.
            while i < n:
                if text[i] == "\\" and i + 1 < n and text[i + 1] == "\n":
                    out.append(" \n")
                    i += 2
                    continue
                if text[i] == "\n":
                    break
                out.append(" ")
                i += 1
            continue
        at_line_start = False
        if c == "\n":
            out.append(c)
            at_line_start = True
            i += 1
        elif text.startswith("//", i):
            while i < n and text[i] != "\n":
                out.append(" ")
                i += 1
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            out.append("".join(ch if ch == "\n" else " " for ch in text[i:end]))
            i = end
        elif c == "R" and i + 1 < n and text[i + 1] == '"' and (
                i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")
                or text[i - 1] in "uU8L"):
            # Raw string R"delim( ... )delim".
            open_paren = text.find("(", i + 2)
            delim = text[i + 2:open_paren] if open_paren >= 0 else ""
            end = text.find(")" + delim + '"', open_paren + 1) if open_paren >= 0 else -1
            end = n if end < 0 else end + len(delim) + 2
            out.append('""' + "".join("\n" if ch == "\n" else "" for ch in text[i:end]))
            i = end
        elif c in "\"'":
            if c == "'" and i > 0 and text[i - 1].isalnum() and i + 1 < n and text[i + 1].isalnum():
                out.append(" ")  # Digit separator: 30'000.
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(c + c)
            i = min(j + 1, n)
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _depth0(head):
    """`head` with everything inside (), [] and <> of templates kept only at depth 0."""
    out, depth = [], 0
    for ch in head:
        if ch in "([":
            depth += 1
            if depth == 1:
                out.append(ch)
            continue
        if ch in ")]":
            depth = max(0, depth - 1)
            if depth == 0:
                out.append(ch)
            continue
        if depth == 0:
            out.append(ch)
    return "".join(out)


def _strip_template_prefix(head):
    head = head.lstrip()
    while head.startswith("template"):
        rest = head[len("template"):].lstrip()
        if not rest.startswith("<"):
            break
        depth, k = 0, 0
        for k, ch in enumerate(rest):
            if ch == "<":
                depth += 1
            elif ch == ">":
                depth -= 1
                if depth == 0:
                    break
        head = rest[k + 1:].lstrip()
    return head


def _in_initializer_list(head):
    """True if `head` is a constructor head whose initializer list is still open."""
    flat = _depth0(head)
    m = re.search(r"\)\s*(?:noexcept\s*)?:(?!:)", flat)
    return bool(m) and bool(_IDENT_END.search(flat))


_ATTRIBUTE = re.compile(r"__attribute__\s*\(\((?:[^()]|\([^()]*\))*\)\)")


def _normalize(head):
    """One-line `head` without a leading template<...> and GCC attributes."""
    return _strip_template_prefix(_ATTRIBUTE.sub(" ", " ".join(head.split())))


def classify(head):
    """'namespace', 'class', 'function' or 'block' for the text before a `{`."""
    head = _normalize(head)
    flat = _depth0(head)
    if _NAMESPACE.search(flat):
        return "namespace"
    if _ENUM.search(flat):
        return "block"
    if "(" not in flat:
        return "class" if _RECORD.search(flat) else "block"
    first = re.match(r"\s*([A-Za-z_]\w*)", flat)
    if first and first.group(1) in _CONTROL:
        return "block"
    if "operator" not in flat:
        before_paren = flat[:flat.index("(")]
        if "=" in before_paren:
            return "block"  # A variable's initializer (lambda, braces).
        if _RECORD.search(before_paren) and not re.search(r"\)\s*$", flat.split(":")[0]):
            return "class"
    # A parameter list followed by qualifiers, a trailing return type or an initializer list.
    if not re.search(r"\)", flat):
        return "block"
    return "function"


def function_name(head):
    """The name before the parameter list; macros such as TEST keep their arguments."""
    head = _normalize(head)
    flat = _depth0(head)
    op = re.search(r"((?:[A-Za-z_]\w*::)*operator\s*(?:\(\)|[^\s(]+))\s*\(", head)
    if op:
        return op.group(1).replace(" ", "")
    idx = flat.find("(")
    m = re.search(r"((?:[A-Za-z_~]\w*::)*~?[A-Za-z_]\w*)\s*$", flat[:idx])
    name = m.group(1) if m else "?"
    if re.fullmatch(r"[A-Z][A-Z0-9_]+", name):  # A macro: TEST, TEST_F, ...
        args = re.search(re.escape(name) + r"\s*(\([^()]*\))", head)
        if args:
            return name + args.group(1).replace(" ", "")  # One field in the output.
    return name


def find_functions(text):
    """Yields (line, name, length) for every function definition in C++ source `text`."""
    code = strip_code(text)
    line_of = []
    line = 1
    for ch in code:
        line_of.append(line)
        if ch == "\n":
            line += 1
    # Scope stack entries: (kind, start_index_of_name_or_-1, name).
    stack = []
    head_start = 0
    i, n = 0, len(code)
    while i < n:
        ch = code[i]
        inside_function = any(kind == "function" for kind, _, _ in stack)
        if ch == ";":
            if not inside_function:
                head_start = i + 1
        elif ch == "{":
            if inside_function:
                stack.append(("block", -1, ""))
            else:
                head = code[head_start:i]
                if head.count("(") > head.count(")") or _in_initializer_list(head):
                    # Braces inside a parameter list or an initializer (`T{}`, `a_{1}`), not
                    # a body: skip to the matching '}'.
                    depth = 0
                    while i < n:
                        if code[i] == "{":
                            depth += 1
                        elif code[i] == "}":
                            depth -= 1
                            if depth == 0:
                                break
                        i += 1
                    i += 1
                    continue
                kind = classify(head)
                if kind == "function":
                    name = function_name(head)
                    flat = head
                    idx = _name_index(flat, name)
                    start = head_start + idx if idx >= 0 else i
                    stack.append(("function", start, name))
                else:
                    stack.append((kind, -1, ""))
                head_start = i + 1
        elif ch == "}":
            if stack:
                kind, start, name = stack.pop()
                if kind == "function":
                    first = line_of[start]
                    yield first, name, line_of[i] - first + 1
            if not any(kind == "function" for kind, _, _ in stack):
                head_start = i + 1
        elif ch == ":" and not inside_function:
            # Access specifiers end a head ("public:"), scope operators do not.
            tail = code[head_start:i].strip()
            if tail in ("public", "private", "protected") and code[i + 1:i + 2] != ":":
                head_start = i + 1
        i += 1


def _name_index(head, name):
    base = name.split("(")[0].split("::")[-1]
    m = None
    for m in re.finditer(re.escape(base), head):
        pass
    if m is None:
        return -1
    # The first occurrence of the qualified name's start, so Class::Method counts from Class.
    qualified = name.split("(")[0]
    k = head.rfind(qualified)
    if k >= 0:
        return k
    return m.start()


def iter_files(paths):
    for path in paths:
        if os.path.isfile(path):
            yield path
            continue
        for root, dirs, files in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith(("bazel-", ".")))
            for f in sorted(files):
                if f.endswith(".cc"):
                    yield os.path.join(root, f)


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max", type=int, default=120,
                        help="longest allowed function, in lines (default 120)")
    parser.add_argument("paths", nargs="+", help=".cc files or folders")
    args = parser.parse_args(argv)
    if args.max < 1:
        parser.error("--max must be >= 1")
    missing = [p for p in args.paths if not os.path.exists(p)]
    if missing:
        parser.error("no such file or folder: " + ", ".join(missing))
    found = 0
    for path in iter_files(args.paths):
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        for line, name, length in find_functions(text):
            if length > args.max:
                print(f"{path}:{line} {name} {length}")
                found += 1
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
