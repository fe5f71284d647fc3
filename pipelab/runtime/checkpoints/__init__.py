"""Checkpoints of a distributed pipeline with torch.distributed.checkpoint: saved whole or not at
all, readable by any layout or by one plain model (`checkpoint.py`), each one's manifest and the
checks that find a damaged one (`manifest.py`), a hybrid layout's ranks and sharded tensors
(`sharded.py`), a folder of numbered ones a training run resumes from (`folder.py`)."""
