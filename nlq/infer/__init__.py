"""Using a trained model: load it from a run dir, a checkpoint or a saved folder, with the
tokenizer of the data it trained on (load.py), and the `nlq sample` command (cli.py)."""
