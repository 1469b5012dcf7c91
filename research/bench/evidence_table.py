"""One table across rewards (and horizons): which variants beat DDPO net of drift, and by how much.

    python -m research.bench.evidence_table \\
        --drift "JPEG, 15 epochs=research/results/study/drift_evidence_jpeg_compressibility.json" \\
                "alignment, 15 epochs=research/results/study_alignment/drift_evidence_tinyworld_alignment.json" \\
        --out research/results/evidence_summary

Reads the JSON that `drift` wrote for each reward (its first row is the baseline, DDPO) and puts
the issue's two tests side by side for every variant found in the first file:
- separated: the paired t-test of net gain against the baseline (per seed, each run net of its own
  shuffled-reward control) has p < --alpha and the mean difference is positive;
- fewer queries: the ratio of reward queries the baseline needs to reach its own final net reward
  to what the variant needs (drift's "cost to reach" on seed-mean net curves); "not reached" is 0.
  The test counts the "held" ratio, from the epoch after which the variant stays at or above the
  target: a curve that crosses early and falls back below by the end has not reached it;
- raw held-out: the trained policy's held-out reward against the baseline's same-seed run, no
  control involved. Net gain subtracts the control's drift, so a variant whose control collapses
  (both runs lose the image, the control more) can look separated while its own reward falls;
  this column is the check a control cannot move.
The last three columns say whether a variant passes each test in every file: ">= 3x on all" is
the question as worded, "separated on all" is whether that gain is a finding, "raw held-out above
on all" whether the trained policy is better where no control is subtracted (none is answered for
a variant some file lacks). Nothing is recomputed
from runs here: the numbers are drift's, so this file cannot disagree with the per-reward ones.
Writes <out>.md and <out>.json.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from research.bench.common import write_json


def load_drift(path: Path) -> dict:
    if not path.exists():
        raise SystemExit(f"--drift: {path} does not exist; run `python -m research.bench.drift` for that study first")
    data = json.loads(path.read_text())
    if not data.get("rows"):
        raise SystemExit(f"--drift: {path} has no rows; is it a file that `drift` wrote?")
    return data


def variant_cells(data: dict, variant: str) -> dict | None:
    """The numbers of one variant in one drift file, or None if the file does not have it."""
    row = next((r for r in data["rows"] if r["variant"] == variant), None)
    if row is None or not row.get("seeds"):
        return None
    cost = next((r for r in data.get("net_cost_to_reach", []) if r["variant"] == variant), {})
    q = (cost.get("reach") or {}).get("queries")
    ratio = None if q is None else (q["ratio"] if q.get("variant") is not None else 0.0)
    # drift files written before "held" existed lack the key: their held ratio is unknown, not 0
    held = None if q is None or "held_variant" not in q else (q["held_ratio"] if q["held_variant"] is not None else 0.0)
    baseline = row is data["rows"][0]
    vs = row.get("vs_baseline") or {}
    return {"seeds": len(row["seeds"]), "net": row["net"], "gain": row.get("gain"), "baseline": baseline,
            "vs": None if baseline else vs, "heldout_vs": None if baseline else (row.get("heldout_vs_baseline") or {}),
            "heldout_raw_vs": None if baseline else (row.get("heldout_raw_vs_baseline") or {}),
            "query_ratio": ratio, "held_query_ratio": held}


def _above(t: dict | None, alpha: float) -> bool:
    t = t or {}
    return t.get("p") is not None and t["p"] < alpha and t["mean"] > 0


def separated(cells: dict | None, alpha: float) -> bool:
    return _above((cells or {}).get("vs"), alpha)


def raw_heldout_above(cells: dict | None, alpha: float) -> bool:
    return _above((cells or {}).get("heldout_raw_vs"), alpha)


def fold_reached(cells: dict, fold: float) -> bool:
    ratio = cells["held_query_ratio"] if cells["held_query_ratio"] is not None else cells["query_ratio"]
    return (ratio or 0.0) >= fold


def summarise(files: dict[str, dict], alpha: float, fold: float) -> list[dict]:
    first = next(iter(files.values()))
    rows = []
    for r in first["rows"]:
        v = r["variant"]
        per = {label: variant_cells(data, v) for label, data in files.items()}
        present = [c for c in per.values() if c is not None]
        complete = len(present) == len(files)
        row = {"variant": v, "per_file": per}
        if r is not first["rows"][0]:
            # None, not False, where a setting lacks the variant: "not run" is not "failed"
            row["fold_on_all"] = all(fold_reached(c, fold) for c in present) if complete else None
            row["separated_on_all"] = all(separated(c, alpha) for c in present) if complete else None
            row["raw_heldout_on_all"] = all(raw_heldout_above(c, alpha) for c in present) if complete else None
        rows.append(row)
    return rows


def _p(t: dict) -> str:
    if not t or t.get("p") is None:
        return "-"
    return f"{t['mean']:+.3f}, p = {t['p']:.3f}, {t['above']}/{t['n']}"


def markdown(files: dict[str, dict], rows: list[dict], alpha: float, fold: float) -> str:
    base = rows[0]["variant"]
    head = ["variant"]
    for label in files:
        head += [f"{label}: net gain", f"net - {base}", f"held-out net - {base}", f"held-out raw - {base}",
                 "queries to its final net"]
    head += [f">= {fold:g}x on all (held)", f"separated on all (p < {alpha:g})", "raw held-out above on all"]
    lines = [f"### Net of drift, against {base}, on {len(files)} reward/horizon settings", "",
             "Per setting (numbers from that setting's `drift` file): net gain = reward run - its shuffled-reward control, "
             f"mean ± s.e. over seeds; the paired differences against {base} (mean, two-sided p of a paired t-test, seeds ahead); "
             f"the trained policy's held-out reward against {base}'s same-seed run, no control subtracted; "
             f"the fold fewer reward queries to reach {base}'s final net reward (seed-mean net curves; \"falls below\" "
             "where the curve crosses and is below again by the end). "
             f"The last three columns: does the variant reach it in >= {fold:g}x fewer queries and stay there in every setting, "
             f"is its net gain above {base}'s with p < {alpha:g} in every setting, and is its raw held-out reward above "
             f"{base}'s with p < {alpha:g} in every setting.", "",
             "| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for row in rows:
        cells = [row["variant"]]
        for label in files:
            c = row["per_file"][label]
            if c is None:
                cells += ["not run", "-", "-", "-", "-"]
                continue
            net = f"{c['net'][0]:+.3f} ± {c['net'][1]:.3f} ({c['seeds']})" if c["net"][1] is not None else f"{c['net'][0]:+.3f} ({c['seeds']})"
            ratio = "-" if c["query_ratio"] is None else ("not reached" if c["query_ratio"] == 0 else f"{c['query_ratio']:.2f}x")
            if c["query_ratio"] and c["held_query_ratio"] == 0:
                ratio += ", falls below by the end"
            elif c["query_ratio"] and c["held_query_ratio"] and c["held_query_ratio"] != c["query_ratio"]:
                ratio += f" ({c['held_query_ratio']:.2f}x held)"
            cells += [net, "-" if c["baseline"] else _p(c["vs"]), "-" if c["baseline"] else _p(c["heldout_vs"]),
                      "-" if c["baseline"] else _p(c["heldout_raw_vs"]), "1.00x" if c["baseline"] else ratio]
        if "fold_on_all" in row and row["fold_on_all"] is None:
            cells += ["not run in every setting"] * 3
        elif "fold_on_all" in row:
            cells += ["yes" if row["fold_on_all"] else "no", "**yes**" if row["separated_on_all"] else "no",
                      "**yes**" if row["raw_heldout_on_all"] else "no"]
        else:
            cells += ["-", "-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + [""])


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drift", nargs="+", required=True, metavar="LABEL=PATH", help="a drift JSON per reward/horizon, with its column label")
    ap.add_argument("--out", type=Path, required=True, help="output stem: writes STEM.md and STEM.json")
    ap.add_argument("--alpha", type=float, default=0.05, help="p below which a paired difference counts as separated")
    ap.add_argument("--fold", type=float, default=3.0, help="the fewer-queries bar (the issue's 3x)")
    args = ap.parse_args(argv)
    files, paths = {}, {}
    for spec in args.drift:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            ap.error(f"--drift {spec!r}: expected LABEL=PATH, e.g. 'JPEG, 15 epochs=research/results/study/drift_evidence_jpeg_compressibility.json'")
        if label in files:
            ap.error(f"--drift: the label {label!r} is given twice")
        files[label], paths[label] = load_drift(Path(path)), path
    rows = summarise(files, args.alpha, args.fold)
    text = markdown(files, rows, args.alpha, args.fold)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_json(args.out.with_suffix(".json"), {"files": paths,
                                               "alpha": args.alpha, "fold": args.fold, "rows": rows})
    args.out.with_suffix(".md").write_text(text)
    print(text)
    return rows


if __name__ == "__main__":
    main()
