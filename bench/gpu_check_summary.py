"""The verdict of bench/gpu_check.sh from what its work folder holds: prints summary.txt (the one
screen to read first) and writes gpu_check.json beside the logs; exit 0 when everything passed.

It reads only files, so it runs after every step (a check cut short still says how far it got)
and in the CPU rehearsal on canned logs (tests/test_gpu_check.py):
  steps.txt          one line per event of the script: "step NAME rc=.. seconds=.. limit=..",
                     "budget N", "import_path installed|PYTHONPATH|broken", "fla V", "elapsed N",
                     "skipped ...", "interrupted ..."
  tests_*.xml / .log pytest's JUnit XML (counts) and log (the failures' short lines)
  *.log              any "CUDA graph capture failed" warning (the runner falls back to eager with it)
  e2e_*.json         bench_e2e's rows; a graph row with graph_captured false timed eager code
  kernels_*.json     bench_kernels' rows (triton_error fails the check)
  mtp-*.json         bench_mtp's rows: the embedded model's modes side by side, AR+MTP among them
  roofline.log, kernels_vs_roofline.log  the CPU-side plans, quoted

    python bench/gpu_check_summary.py WORKDIR
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

CAPTURE_WARNING = "CUDA graph capture failed"
NEAR_LIMIT = 0.8  # a step that used this much of its limit is flagged: the next run may lose it


def read_steps(work: Path) -> tuple[dict, dict]:
    """(steps by name: rc, seconds, limit; facts: budget, import_path, fla, elapsed, skipped, interrupted)."""
    steps, facts = {}, {"skipped": [], "interrupted": None}
    path = work / "steps.txt"
    for line in path.read_text().splitlines() if path.exists() else []:
        key, _, rest = line.partition(" ")
        if key == "step":
            name, *fields = rest.split()
            steps[name] = {k: int(v) for k, v in (f.split("=", 1) for f in fields)}
        elif key in ("budget", "elapsed"):
            facts[key] = int(rest)
        elif key in ("import_path", "fla"):
            facts[key] = rest
        elif key == "skipped":
            facts["skipped"].append(rest)
        elif key == "interrupted":
            facts["interrupted"] = rest
    return steps, facts


def test_counts(work: Path, name: str) -> dict:
    """passed / failed / errors / skipped of one pytest step, from its JUnit XML (absent when the
    process was killed: then the log's failure lines are all there is)."""
    out = dict(passed=0, failed=0, errors=0, skipped=0, xml=False, failures=[])
    xml = work / f"{name}.xml"
    if xml.exists():
        try:
            root = ET.parse(xml).getroot()
            for suite in ([root] if root.tag == "testsuite" else root.iter("testsuite")):
                n = int(suite.get("tests", 0))
                f, e, s = (int(suite.get(k, 0)) for k in ("failures", "errors", "skipped"))
                out["failed"] += f
                out["errors"] += e
                out["skipped"] += s
                out["passed"] += n - f - e - s
            out["xml"] = True
        except ET.ParseError:
            pass
    log = work / f"{name}.log"
    if log.exists():
        out["failures"] = [line for line in log.read_text(errors="replace").splitlines()
                           if line.startswith(("FAILED ", "ERROR "))][:20]
    return out


def capture_warnings(work: Path) -> list[str]:
    found = []
    for log in sorted(work.glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if CAPTURE_WARNING in line:
                found.append(f"{log.name}: {line.strip()[:300]}")
    return found


def newest(work: Path, pattern: str) -> dict | None:
    files = sorted(work.glob(pattern), key=lambda p: p.stat().st_mtime)
    for path in reversed(files):
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue  # a file being written: the one before it
    return None


def section(work: Path, name: str, start: str, stop: str | None = None, prefixes: tuple = ()) -> list[str]:
    path = work / name
    if not path.exists():
        return []
    lines = path.read_text(errors="replace").splitlines()
    if prefixes:
        return [line for line in lines if line.startswith(prefixes)]
    out, inside = [], False
    for line in lines:
        inside = inside or line.startswith(start)
        if inside and stop and line.startswith(stop):
            break
        if inside:
            out.append(line)
    return out


def summarise(work: Path) -> tuple[list[str], dict]:
    steps, facts = read_steps(work)
    lines, problems = [], []
    env = (work / "env.txt").read_text(errors="replace").splitlines() if (work / "env.txt").exists() else []
    device = next((line.split(" ", 1)[1] for line in env if line.startswith("device ")), "?")
    versions = ", ".join(line for line in env if line.startswith(("torch ", "triton ")))
    lines.append(f"gpu_check on {device} ({versions or 'versions unknown'}); budget {facts.get('budget', '?')}s, "
                 f"{facts.get('elapsed', '?')}s elapsed")

    install = steps.get("install")
    path = facts.get("import_path", "?")
    lines.append(f"install rc={install['rc'] if install else '-'}; import path: {path}; fla: {facts.get('fla', '?')}")
    if path not in ("installed", "PYTHONPATH"):
        problems.append(f"the project does not import (import path {path})")

    for name, s in sorted(steps.items()):  # times against limits: what the next run may lose
        if s.get("limit") and s["seconds"] >= NEAR_LIMIT * s["limit"]:
            killed = s["rc"] in (124, 137)
            msg = f"step {name} {'was killed at' if killed else 'took'} {s['seconds']}s of its {s['limit']}s limit"
            lines.append("LIMIT: " + msg)
            if killed:
                problems.append(msg)

    tests = {}
    for name in sorted(n for n in steps if n.startswith("tests_")):
        s, c = steps[name], test_counts(work, name)
        tests[name] = dict(c, rc=s["rc"], seconds=s["seconds"])
        ok = s["rc"] in (0, 5) and not c["failed"] and not c["errors"]  # 5: nothing selected
        label = name.removeprefix("tests_")
        if ok and not c["passed"] and not c["skipped"]:
            continue  # a dtype part with nothing in it
        lines.append(f"tests {label}: {c['passed']} passed, {c['failed']} failed, {c['errors']} errors, "
                     f"{c['skipped']} skipped, rc={s['rc']}, {s['seconds']}s" + ("" if c["xml"] else " (no XML)"))
        lines += [f"    {f}" for f in c["failures"]]
        if not ok:
            problems.append(f"tests {label}: rc={s['rc']}, {c['failed']} failed, {c['errors']} errors")

    if not any(c["passed"] for name, c in tests.items() if name.startswith("tests_test_kernel")):
        problems.append("no kernel test passed")

    # CUDA graphs: the capture test passed (not skipped), no fall-back warning, e2e graph rows captured
    graphs = {"capture_test": None, "warnings": capture_warnings(work), "e2e_rows_not_captured": []}
    cap = tests.get("tests_graphs_capture")
    if cap is None:
        graphs["capture_test"] = "not run"
    elif cap["rc"] == 0 and cap["passed"] == 1:
        graphs["capture_test"] = "passed"
    else:
        graphs["capture_test"] = "skipped (no CUDA seen by pytest)" if cap["skipped"] else f"failed (rc={cap['rc']})"
    e2e = newest(work, "e2e_*.json")
    for row in (e2e or {}).get("rows", []):
        if "graph_captured" in row and not row["graph_captured"]:
            graphs["e2e_rows_not_captured"].append(f"{row['step']} [{row['variant']}]: {row.get('graph_error')}")
    graphs["ok"] = (graphs["capture_test"] == "passed" and not graphs["warnings"]
                    and not graphs["e2e_rows_not_captured"])
    lines.append(f"CUDA graphs: capture test {graphs['capture_test']}; fall-back warnings: {len(graphs['warnings'])}; "
                 f"e2e graph rows not captured: {len(graphs['e2e_rows_not_captured'])}")
    lines += [f"    {w}" for w in graphs["warnings"][:5] + graphs["e2e_rows_not_captured"][:5]]
    if not graphs["ok"]:
        problems.append("CUDA graph capture not shown to work")

    bench = newest(work, "kernels_*.json")
    s = steps.get("bench_kernels")
    errors = [r for r in (bench or {}).get("rows", []) if "triton_error" in r]
    rows = len((bench or {}).get("rows", []))
    lines.append(f"bench_kernels: rc={s['rc'] if s else '-'}, {rows} rows"
                 f"{' (incomplete)' if bench and not bench.get('complete', True) else ''}, {len(errors)} errors")
    lines += [f"    {r['op']} {r['shape']}: {r['triton_error'][:200]}" for r in errors[:5]]
    if s is None or s["rc"] != 0 or errors or not rows:
        problems.append(f"bench_kernels: rc={s['rc'] if s else 'not run'}, {len(errors)} kernel errors, {rows} rows")
    lines += section(work, "kernels_vs_roofline.log", "measured on", "wrote")

    s = steps.get("bench_mtp")
    mtp = newest(work, "mtp-*.json")
    mtp_rows = (mtp or {}).get("rows", [])
    lines.append(f"bench_mtp: rc={s['rc'] if s else '-'}, {len(mtp_rows)} modes (embedded model, held-out prompts)")
    for r in mtp_rows:
        lines.append(f"    {r['mode']:<12} {r['tokens_per_forward']:5.2f} tok/fwd {r['tokens_per_second']:9.1f} tok/s "
                     f"{r['vs_ar']:5.2f}x AR{'' if r['equals_ar'] else '  (tokens differ from AR)'}")
    if s is None or s["rc"] != 0 or not any(r["mode"] == "ar+mtp" for r in mtp_rows):
        problems.append(f"bench_mtp: rc={s['rc'] if s else 'not run'}, "
                        f"{'an ar+mtp row' if any(r['mode'] == 'ar+mtp' for r in mtp_rows) else 'no ar+mtp row'}")

    s = steps.get("bench_e2e")
    e2e_rows = (e2e or {}).get("rows", [])
    lines.append(f"bench_e2e: rc={s['rc'] if s else '-'}, {len(e2e_rows)} rows"
                 f"{'' if (e2e or {}).get('complete') else ' (incomplete)'}" + "".join(f"; {x}" for x in facts["skipped"]))
    for r in e2e_rows:
        tps = f", {r['tokens_per_s']:.1f} tok/s" if r.get("tokens_per_s") else ""
        lines.append(f"    {r['step']:<20} {r['variant']:<28} {r['median_s'] * 1e3:9.2f} ms  roofline "
                     f"{r['roofline_s'] * 1e3:7.3f} ms  x{r['time_over_roofline']:.1f}{tps}")
    if s is None or s["rc"] != 0:
        problems.append(f"bench_e2e: rc={s['rc'] if s else 'not run'}")

    roof = section(work, "roofline.log", "", prefixes=("AR step", "preview 32", "commit+preview"))
    if roof:
        lines.append("H200 roofline plan (bench/roofline.py, uniform routing; e2e above counts the experts really hit):")
        lines += roof
    if facts["interrupted"]:
        problems.append(f"interrupted: {facts['interrupted']}")
    lines.append("PASS" if not problems else "FAIL: " + "; ".join(problems))
    verdict = dict(passed=not problems, problems=problems, steps=steps, facts=facts, tests=tests, graphs=graphs)
    return lines, verdict


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python bench/gpu_check_summary.py WORKDIR", file=sys.stderr)
        return 2
    work = Path(argv[0])
    lines, verdict = summarise(work)
    print("\n".join(lines))
    (work / "gpu_check.json").write_text(json.dumps(verdict, indent=1) + "\n")
    return 0 if verdict["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
