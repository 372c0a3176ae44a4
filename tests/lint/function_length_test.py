#!/usr/bin/python3
"""Tests of function_length.py: /usr/bin/python3 tests/lint/function_length_test.py"""

import io
import os
import sys
import tempfile
import unittest
from contextlib import redirect_stdout

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import function_length  # noqa: E402


def functions(src):
    return [(name, line, length) for line, name, length in function_length.find_functions(src)]


class FindFunctionsTest(unittest.TestCase):

    def test_free_functions_methods_and_lengths(self):
        src = (
            "namespace a {\n"                       # 1
            "int F(int x) {\n"                      # 2
            "  return x;\n"                         # 3
            "}\n"                                   # 4
            "absl::StatusOr<std::vector<int>> C::G(const std::string& s) const {\n"  # 5
            "  if (s.empty()) { return {}; }\n"     # 6
            "  for (int i = 0; i < 3; ++i) {\n"     # 7
            "  }\n"                                 # 8
            "  return std::vector<int>{1, 2};\n"    # 9
            "}\n"                                   # 10
            "}  // namespace a\n")
        self.assertEqual(functions(src), [("F", 2, 3), ("C::G", 5, 6)])

    def test_braces_in_strings_comments_and_chars_are_ignored(self):
        src = (
            "void F() {\n"
            '  const char* s = "}}}{";  // }\n'
            "  /* { */ char c = '}';\n"
            '  auto r = R"x(}} ")" {)x";\n'
            "  int n = 30'000;\n"
            "}\n"
            "void G() {}\n")
        self.assertEqual(functions(src), [("F", 1, 6), ("G", 7, 1)])

    def test_multiline_raw_string_keeps_line_numbers(self):
        src = 'const char* k = R"(\n{\n{\n)";\nvoid F() {\n}\n'
        self.assertEqual(functions(src), [("F", 5, 2)])

    def test_constructor_with_brace_initializers(self):
        src = (
            "Foo::Foo(Options o)\n"
            "    : a_(1), b_{2, 3}, c_{} {\n"
            "  Init();\n"
            "}\n")
        self.assertEqual(functions(src), [("Foo::Foo", 1, 4)])

    def test_braces_inside_initializer_expressions(self):
        src = (
            "C::C(int n)\n"
            "    : id_(static_cast<uint64_t>(std::random_device{}()) << 32),\n"
            "      v_(n, 0) {\n"
            "}\n"
            "__attribute__((optimize(\"x\"))) void Add(const char* s) {\n"
            "}\n")
        self.assertEqual(functions(src), [("C::C", 1, 4), ("Add", 5, 2)])

    def test_classes_and_inline_methods(self):
        src = (
            "template <class T>\n"
            "class Box : public Base {\n"
            " public:\n"
            "  int size() const { return n_; }\n"
            "  void Set(int n) ABSL_LOCKS_EXCLUDED(mu_) {\n"
            "    n_ = n;\n"
            "  }\n"
            " private:\n"
            "  int n_ = 0;\n"
            "};\n"
            "struct P { int x; };\n"
            "enum class E { kA, kB };\n")
        self.assertEqual(functions(src), [("size", 4, 1), ("Set", 5, 3)])

    def test_lambdas_and_initializers_are_not_functions(self):
        src = (
            "auto kF = [](int x) { return x; };\n"
            "constexpr std::pair<int, int> kP[] = {{1, 2}, {3, 4}};\n"
            "void Outer() {\n"
            "  auto f = [&](int y) {\n"
            "    return y;\n"
            "  };\n"
            "}\n")
        self.assertEqual(functions(src), [("Outer", 3, 5)])

    def test_test_macros_keep_their_arguments(self):
        src = "TEST_F(Fixture, DoesThings) {\n  EXPECT_TRUE(true);\n}\n"
        self.assertEqual(functions(src), [("TEST_F(Fixture,DoesThings)", 1, 3)])

    def test_operators_and_destructors(self):
        src = (
            "bool operator==(const A& a, const A& b) { return true; }\n"
            "Foo::~Foo() {\n"
            "}\n")
        self.assertEqual(functions(src), [("operator==", 1, 1), ("Foo::~Foo", 2, 2)])

    def test_preprocessor_lines_are_ignored(self):
        src = "#define OPEN {\n#include <x>\nvoid F() {\n}\n"
        self.assertEqual(functions(src), [("F", 3, 2)])


class MainTest(unittest.TestCase):

    def test_reports_long_functions_and_exit_status(self):
        with tempfile.TemporaryDirectory() as d:
            os.makedirs(os.path.join(d, "sub"))
            os.makedirs(os.path.join(d, "bazel-out"))
            body = "".join("  x();\n" for _ in range(5))
            with open(os.path.join(d, "sub", "a.cc"), "w") as f:
                f.write("void Long() {\n" + body + "}\nvoid Short() {\n}\n")
            with open(os.path.join(d, "bazel-out", "b.cc"), "w") as f:
                f.write("void Skipped() {\n" + body + "}\n")
            with open(os.path.join(d, "sub", "a.h"), "w") as f:
                f.write("void NotScanned() {\n" + body + "}\n")
            out = io.StringIO()
            with redirect_stdout(out):
                rc = function_length.main(["--max", "6", d])
            self.assertEqual(rc, 1)
            self.assertEqual(out.getvalue(), os.path.join(d, "sub", "a.cc") + ":1 Long 7\n")
            out = io.StringIO()
            with redirect_stdout(out):
                rc = function_length.main(["--max", "7", d])
            self.assertEqual((rc, out.getvalue()), (0, ""))


if __name__ == "__main__":
    unittest.main()
