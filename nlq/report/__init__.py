"""Reports of experiments (`nlq report`, `nlq export`): reading run dirs (runs.py),
statistics over seeds and the bootstrap (stats.py, bootstrap.py), the pre-registered
comparisons and their verdicts (claims.py, compare.py, verdicts.py), report.json and
report.md (report.py, summary.py, markdown*.py), Fig. 1 (figure.py), and what of a folder to
commit (export.py). Scoring a trained model on a split is `nlq eval`, in nlq/infer/."""
