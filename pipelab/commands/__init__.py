"""The entry points: the `pipelab` command (`cli.py`: run, simulate, plan, search, lab, grade),
torchrun's `python -m pipelab.launch` (`launch.py`), the training run both start (`training.py`,
with `resume.py`; its summary, `run_report.py`), the models and data they train on
(`run_models.py`) and the planner's commands (`planning.py`).  The top layer: may import
everything in the package."""
