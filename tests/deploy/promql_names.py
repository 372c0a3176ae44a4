#!/usr/bin/python3
"""Checks the PromQL of the Grafana dashboard and of the Prometheus rules.

  promql_names.py DASHBOARD.json RULES.yml EXPORTED.txt OUT_RULES.yml

* Writes every dashboard expression (Grafana variables replaced by plain values) into
  OUT_RULES.yml as a recording rule, for `promtool check rules` to parse.
* Checks that every metric name in the dashboard's and the rules' expressions is one the
  daemons export (EXPORTED.txt, one name a line), `up`, or a name the rules record.
Prints one line per problem and exits 1 if there is any.
"""
import json
import re
import sys

KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
            "unless", "offset", "bool", "inf", "nan", "atan2"}


def exprs_of_dashboard(d):
    out = []
    def walk(panels):
        for p in panels:
            walk(p.get("panels", []))
            for t in p.get("targets", []):
                out.append((f'panel {p.get("id")} "{p.get("title")}" {t.get("refId")}', t["expr"]))
    walk(d["panels"])
    for v in d.get("templating", {}).get("list", []):
        q = v.get("query")
        if isinstance(q, dict):
            q = q.get("query", "")
        m = re.match(r"label_values\((.*),\s*\w+\)$", q or "")
        if m:
            out.append((f'variable {v["name"]}', m.group(1)))
    return out


def grafana_to_promql(e):
    e = e.replace("$__rate_interval", "1m").replace("$__interval", "1m").replace("$__range", "1h")
    return re.sub(r"\$\{?\w+\}?", ".*", e)


def metric_names(e):
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', e)             # string literals
    e = re.sub(r"\{[^}]*\}", "", e)                         # label matchers
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\[[^\]]*\]", "", e)                        # ranges
    e = re.sub(r"\boffset\s+\w+", " ", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        tail = e[m.end():].lstrip()
        if tail.startswith("("):
            continue                                        # a function
        if m.group(0) in KEYWORDS or (m.start() > 0 and e[m.start() - 1].isdigit()):
            continue
        names.add(m.group(0))
    return names


def main():
    dash_path, rules_path, exported_path, out_path = sys.argv[1:5]
    dash = json.load(open(dash_path))
    exported = {l.strip() for l in open(exported_path) if l.strip()}
    rules_text = open(rules_path).read()
    recorded = set(re.findall(r"^\s*- record:\s*(\S+)", rules_text, re.M))
    known = exported | recorded | {"up"}
    problems = []
    ids = [p.get("id") for p in dash["panels"]]
    if len(ids) != len(set(ids)):
        problems.append("dashboard: panel ids are not unique")
    exprs = exprs_of_dashboard(dash)
    if not exprs:
        problems.append("dashboard: no expressions")
    with open(out_path, "w") as out:
        out.write("groups:\n  - name: dashboard\n    rules:\n")
        for i, (where, e) in enumerate(exprs):
            q = grafana_to_promql(e)
            out.write(f"      - record: dashboard:expr_{i}\n        expr: {json.dumps(q)}\n")
            for n in sorted(metric_names(q) - known):
                problems.append(f"dashboard {where}: {n} is not exported by any daemon nor recorded")
    # The rules' own expressions (after `expr:`; block scalars folded).
    for m in re.finditer(r"^(\s*)expr:\s*>?\s*\n?((?:\1\s+.*\n)+|.*\n)", rules_text, re.M):
        for n in sorted(metric_names(m.group(2)) - known):
            problems.append(f"rules: {n} is not exported by any daemon nor recorded")
    for p in problems:
        print(p)
    print(f"{len(exprs)} dashboard expressions, {len(known)} known names, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
