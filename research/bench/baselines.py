"""Write the package's DDPO band data (deploy/ddpo_baselines.json) from the study's DDPO runs.

    python -m research.bench.baselines [--results research/results] [--out deploy/ddpo_baselines.json]

Rerun after a study adds DDPO seeds; tests/test_baseline.py fails while the file is out of date.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from diffrlhf.deploy.baseline import BASELINES_FILE, baselines_from_runs
from research.bench.common import RESULTS_DIR
from research.controls import CONTROLS


def render(results_dir: Path) -> str:
    # The controls' bands stay here: a user's config can name no control.
    entries = [b for b in baselines_from_runs(results_dir) if b["identity"].get("reward.spec") not in CONTROLS]
    return json.dumps({"source": "research/results/<study>/runs/<reward>/uniform__none (research/bench/baselines.py)",
                       "baselines": entries}, separators=(",", ":")) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=RESULTS_DIR)
    ap.add_argument("--out", type=Path, default=BASELINES_FILE)
    a = ap.parse_args(argv)
    a.out.write_text(render(a.results))
    print(f"[baselines] {len(json.loads(a.out.read_text())['baselines'])} settings -> {a.out}")


if __name__ == "__main__":
    main()
