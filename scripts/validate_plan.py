"""How good is `neuron-train plan`'s calibration? Prints, computed by the plan's own code
(neuron_train/cost/plan_calibrate.py) over the published Neuron rows it ships
(neuron_train/data/plan_published.yaml):

- leave-one-out median absolute error of the throughput estimate over the training rows and over
  the inference rows (each row predicted from the fraction of peak fitted on all the others);
- trn1.2xlarge -> inf2.xlarge cross-prediction error on the 14 encoder pairs (the fraction fitted on
  the trn1 row alone predicts the inf2 row), and whether the price-performance ranking of the two
  instance types comes out right in each pair.

Targets (issue 23): cross-prediction median error <= 10%, leave-one-out <= 30%, ranking right in
every pair. `--json` prints the figures as JSON (the test reads them). Exit 0 whether or not a
target is met: the figures are the result.

    python scripts/validate_plan.py [--json] [--rows]
"""

from __future__ import annotations

import argparse
import json
import statistics

from neuron_train.cost.plan_calibrate import (
    MODES,
    cross_predict,
    fitted_rows,
    leave_one_out,
    published_calibration,
)

TARGETS = {"loo_median_abs_error": 0.30, "cross_median_abs_error": 0.10}


def figures() -> dict:
    fitted = fitted_rows()
    calib = published_calibration(fitted)
    out: dict = {"fraction_of_peak": calib.fraction, "error_band": calib.band, "loo": {}, "rows": []}
    for mode in MODES:
        errors = leave_one_out(fitted, mode)
        out["loo"][mode] = {"rows": len(errors), "median_abs_error": statistics.median(abs(e) for _, e in errors),
                            "max_abs_error": max(abs(e) for _, e in errors)}
        out["rows"] += [{"row": f.row.label, "mode": mode, "fraction": f.fraction, "loo_error": e} for f, e in errors]
    pairs = cross_predict(fitted)
    out["cross"] = {"pairs": len(pairs), "median_abs_error": statistics.median(abs(p.error) for p in pairs),
                    "ranking_right": sum(p.ranking_right for p in pairs),
                    "each": [{"model": p.model, "source": p.source.row.instance_type,
                              "target": p.target.row.instance_type, "error": p.error,
                              "ranking_right": p.ranking_right} for p in pairs]}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--rows", action="store_true", help="also print every row's error")
    args = parser.parse_args()
    f = figures()
    if args.json:
        print(json.dumps(f, indent=2))
        return 0
    print(f"fraction of peak fitted on the published rows: train {f['fraction_of_peak']['train']:.1%}, "
          f"infer {f['fraction_of_peak']['infer']:.1%}")
    for mode in MODES:
        loo = f["loo"][mode]
        met = "met" if loo["median_abs_error"] <= TARGETS["loo_median_abs_error"] else "NOT met"
        print(f"leave-one-out, {mode}: median absolute error {loo['median_abs_error']:.1%} over {loo['rows']} rows "
              f"(max {loo['max_abs_error']:.0%}; target <= 30%: {met})")
    c = f["cross"]
    met = "met" if c["median_abs_error"] <= TARGETS["cross_median_abs_error"] else "NOT met"
    print(f"trn1.2xlarge -> inf2.xlarge cross-prediction: median absolute error {c['median_abs_error']:.1%} over "
          f"{c['pairs']} encoder pairs (target <= 10%: {met})")
    print(f"price-performance ranking of the pair right in {c['ranking_right']} of {c['pairs']} pairs "
          f"(target: all)")
    if args.rows:
        for r in f["rows"]:
            print(f"  {r['mode']:5} {r['row']:<62} fraction {r['fraction']:.3f}  left out: {r['loo_error']:+.1%}")
        for p in c["each"]:
            print(f"  pair {p['model']:<40} {p['source']} -> {p['target']}: {p['error']:+.1%}"
                  f"{'' if p['ranking_right'] else '  RANKING WRONG'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
