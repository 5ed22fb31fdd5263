"""Using a trained model: load it from a run dir, a checkpoint or a saved folder, with the
tokenizer of the data it trained on (load.py); `nlq sample` and `nlq eval` (cli.py; eval
scores a split as a run scores its test split, evaluate.py, with nlq/run/scoring.py);
`nlq convert` (convert.py). It reads what training wrote through nlq/run/ and imports
nothing of nlq/train."""
