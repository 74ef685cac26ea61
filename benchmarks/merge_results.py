"""Join `sparseforge bench` result files of one configuration run in parts (a run cut by its stage timeout,
then the cases it had not reached) into one file with summary rows over all of them. Each part keeps its
provenance; a case measured twice keeps the later measurement.

    PYTHONPATH=src python benchmarks/merge_results.py OUT.json PART.json [PART.json ...] [--commit SHA]
--commit: the commit every part ran (the device copy's HEAD is stale; its working tree hash names it)."""
import argparse
import json
import sys
from pathlib import Path

from sparseforge.bench.report import summarize


def merge(parts: list[dict]) -> dict:
    cases: dict[tuple, dict] = {}
    for part in parts:
        for record in part["cases"]:
            cases[(record["case"], record["N"], record["dtype"], record["layout"], record.get("batch", 1))] = record
    records = list(cases.values())
    return {"provenance": [p["provenance"] for p in parts], "mode": "gpu",
            "merged_from_parts": len(parts), "summary": summarize(records), "cases": records}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("parts", type=Path, nargs="+")
    parser.add_argument("--commit", default=None)
    args = parser.parse_args()
    merged = merge([json.loads(p.read_text()) for p in args.parts])
    if args.commit:
        merged["commit"] = args.commit
    args.out.write_text(json.dumps(merged, indent=1))
    for row in merged["summary"]:
        print(f"{row['model']} {row['sparsity']} {row['dtype']} {row['layout']} batch {row['batch']}: "
              f"{row['cases']} cases, geomean x cuBLAS {row['geomean_speedup_vs_cublas']:.2f}, "
              f"all correct {row['all_correct']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
