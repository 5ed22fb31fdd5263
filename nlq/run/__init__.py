"""A run's parts shared by training (nlq/train/) and the use of a trained model
(nlq/infer/), so that neither imports the other:

- batches.py: the batches of one rank (train micro-steps, val chunks, test windows);
- scoring.py: the val loss during training and the test split's scores per document and
  per chunk, at the end of a run and in `nlq eval`;
- checkpoint.py: the checkpoint format, its atomic writer and its verifying readers;
- memory.py: the closed-form memory estimate, checked before training or loading a model;
- world.py: the World of ranks and the sum over them (the process group is nlq/train/dist.py).
"""
