"""The course's lessons in one table, for three readers: lesson 00's map, the README's course section and
docs/course.md's, so that no reader can go stale alone.

`LESSONS` is the table: per lesson its number, notebook, title, one line of what you run and see (lesson 00's
map and docs/course.md), the README's longer line, and its graded tasks.  Everything else is generated:

    python -m pipelab.course.course_map     # rewrites lesson 00's map cell and the README's course table

`map_markdown()`, `readme_table()` and `docs_markdown()` are the three texts; tests/test_course_map.py checks the
committed files against them (docs/course.md once it carries its "## The lessons" section).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
TOUR = ROOT / "lessons" / "00_tour.ipynb"
README = ROOT / "README.md"
DOCS = ROOT / "docs" / "course.md"
MAP_CELL = "course-map"  # the id of lesson 00's map cell
DOCS_HEADING = "## The lessons"


class Lesson(NamedTuple):
    number: str      # "08"
    notebook: str    # "08_pp_and_tp_can_be_mixed.ipynb", in lessons/
    title: str       # as lesson 00's map names it
    line: str        # one line: what you run and see
    detail: str      # the README's longer line
    tasks: str       # the README's graded-tasks cell ("—": none)

    @property
    def task_ids(self) -> list[str]:
        """["1.2", "1.3"]: the graded tasks this lesson points to."""
        return re.findall(r"\b\d\.\d\b", self.tasks)


LESSONS: tuple[Lesson, ...] = (
    Lesson('00', '00_tour.ipynb', 'Tour and set-up',
           'what is installed, one pipelined step, its timeline, the explorer',
           'what is installed, one pipelined step, its timeline and grid',
           '—'),
    Lesson('01', '01_splitting.ipynb', 'Splitting a model into stages',
           'split by layers / parameters / measured time; one device busy at a time',
           "the source text's 8 layers on 4 devices; split by layers / parameters / measured time; naive model parallelism",
           '1.1 balanced split (`exercises/partition.py`)'),
    Lesson('02', '02_microbatches.ipynb', 'Micro-batches and gradient accumulation',
           'split and merge; pipelined gradients == single-device gradients',
           'split/merge; pipelined gradients equal single-device gradients',
           "1.2 micro-batches (`microbatch.py`), 1.3 one stage's forward/backward (`stage.py`)"),
    Lesson('03', '03_gpipe.ipynb', 'GPipe: fill, steady state, drain',
           'the bubble (p−1)/(m+p−1), simulated and measured',
           'fill, steady state, drain; bubble formula vs simulation vs measurement; the explorer',
           '2.1 GPipe table (`gpipe.py`), 2.2 bubble (`bubble.py`), 2.3 simulator core (`simulator.py`)'),
    Lesson('04', '04_1f1b_memory.ipynb', '1F1B and activation memory',
           'memory over time, GPipe vs 1F1B',
           'activation memory over time, GPipe vs 1F1B, predicted and observed',
           '3.1 1F1B table (`one_f_one_b.py`), 3.2 in-flight and bytes (`memory.py`)'),
    Lesson('05', '05_checkpointing.ipynb', 'Activation checkpointing',
           'memory saved vs extra time, per stage',
           'memory saved vs time spent; what a memory budget then allows',
           '—'),
    Lesson('06', '06_one_process_to_many.ipynb', 'From one process to many',
           'the same step simulated, replayed and on real processes',
           'one 1F1B step simulated, replayed in one process and on 2 real processes, one above the other; waits for messages and why; the real speed-up against p·m/(m+p−1); the torchrun commands for two machines; a failing rank ending the run; a widget that runs 1–4 processes',
           '4.1 send and receive (`send_recv.py`)'),
    Lesson('07', '07_pipelining_is_not_free.ipynb', '"Pipelining is free"',
           'speed-up vs p and m, the m ≥ 4p rule',
           "speed-up vs p and m, the m >= 4p rule, GPipe's Table 2 beside your numbers",
           '2.2'),
    Lesson('08', '08_pp_and_tp_can_be_mixed.ipynb', '"PP and TP can\'t be mixed"',
           'PP × TP × DP on local processes, same loss as one device; bytes of each kind; what TP does to activations; '
           'pipeline it or shard it (FSDP2)',
           "column- and row-parallel Linears, Megatron's f and g and the scatter/gather at a stage boundary, drawn and computed rank by rank; PP×TP, PP×DP, TP×DP on 4 processes and PP×TP×DP on 8, each with the single-device loss and gradients; one transformer layer written by hand, its saved bytes against Korthikanti et al.'s sbh·(10 + 24/t + 5as/(ht)); the payload of each kind handed to c10d, counted from the real calls beside the formulas; the bubble at a fixed global batch, (p−1)·b·d/B, against the simulator; the layouts of real runs; a widget over (dp, pp, tp) on 16 devices; pipeline it, or shard it: PP2×FSDP2, PP2×DP2 and PP4 on 4 processes, model state per rank observed against ZeRO's table, FSDP's gathers against m, step times",
           '4.2 column- and row-parallel linear (`tensor_parallel.py`)'),
    Lesson('09', '09_deeper_is_not_better.ipynb', '"Deeper pipelines are better"',
           'throughput, bubble, memory and messages as p grows',
           'throughput, bubble, stage-0 memory and messages as p grows at a fixed batch',
           '2.2, 3.2'),
    Lesson('10', '10_pipedream_async.ipynb', 'PipeDream: asynchronous 1F1B, weight stashing',
           'no flush; weight versions and staleness; sync vs async loss curves',
           'no flush: one asynchronous run vs flushed 1F1B steps; weight versions, staleness, stashed-weight memory; synchronous vs asynchronous training per update and per simulated second',
           '5.2 weight stashing (`weight_stashing.py`)'),
    Lesson('11', '11_beyond_1f1b.ipynb', 'Beyond 1F1B: interleaving and zero bubble',
           "bubble, memory and messages vs the formulas; PyTorch's tables checked",
           "interleaved 1F1B and ZB-H1 against their formulas (bubble, memory, messages, latency); the B/W split, exact; PyTorch's tables read, validated (torch 2.13's Schedule1F1B table is wrong) and drawn; interleaving on the engine; DualPipe's published table",
           '5.1 interleaved (`interleaved.py`), 5.3 ZB-H1 (`zero_bubble.py`)'),
    Lesson('12', '12_your_model.ipynb', 'Your own model',
           'a Hugging Face GPT-2 split by module names, exact; tied embeddings; padded batches; a training run over a loader',
           'a Hugging Face GPT-2 from a config split by module names, exact against the plain step; the tied embedding, one weight on two stages; padded batches weighed by samples vs by tokens; BatchNorm and micro-batches; `pl.train` over a padded loader whose batch shape changes every step, every loss the single device\'s',
           '6.1 token weights (`token_weights.py`)'),
    Lesson('13', '13_where_it_is_used.ipynb', 'Where it is used',
           "the course text's five uses, each run: large models, fine-tuning a pretrained model, the cloud, edge inference, two hosts",
           "the course text's five uses, each run: training state per device against p (a 6.7 B GPT on the meta device at 16 bytes a parameter needs p ≥ 2 on 80 GB); a character GPT pretrained on the standard library's docstrings, refused on one device of 16 MiB, fine-tuned on the Zen of Python on 4 stages with stage 0 frozen (the single device's losses; its text before and after), beside naive model parallelism (m = 1, `device_map=\"auto\"`'s way) on the same batch; depth recut 4 → 2 → 4 mid-run (`restage`), losses bit for bit; inference: service time p·t inside the pipeline against throughput m/((m+p−1)·t), `infer` equal to the model, pipelined generation in lanes; PP vs DP vs TP across two hosts at 1 Gbit/s and 100 Mbit/s, predicted beside the recorded benchmark",
           '6.2 forward-only schedule, latency and throughput (`forward_only.py`)'),
    Lesson('14', '14_capstone.ipynb', 'Capstone: plan a training run',
           "the planner's ranked layouts, a run scaled down against its prediction, a schedule search",
           "plan a training run: `pl.plan`'s ranked layouts for a 12.9 B GPT on 64 A100s (a widget: model, GPUs, memory, network), the best row's timeline and memory; ZeRO's sharding of the model state beside the pipeline's; the chosen layout scaled down onto two gloo ranks, predicted vs measured, gradients equal to one device's; `pl.search_schedule` under a memory limit against GPipe, 1F1B and ZB-H1",
           "7.1 the planner's memory check (`plan_memory.py`)"),
    Lesson('99', '99_glossary.ipynb', 'Glossary (English / 繁體中文)',
           'every term in both languages, linked to the lessons that run it',
           'every term of the course and of its source text in English and 繁體中文, a sentence or two each, linked to the lesson sections that run it; a search box in both languages',
           '—'),
)


def map_markdown() -> str:
    """Lesson 00's map: every lesson, a link to it and one line."""
    rows = ["## The course", "", "| # | lesson | what you run and see |", "|---|---|---|"]
    rows += [f"| {x.number} | [{x.title}]({x.notebook}) | {x.line} |" for x in LESSONS if x.number != "00"]
    return "\n".join(rows)


def readme_table() -> str:
    """The README's course table: the notebook, the longer line, the graded tasks."""
    rows = ["| lesson | what you run and see | graded tasks |", "|---|---|---|"]
    rows += [f"| `{x.notebook.removesuffix('.ipynb')}` | {x.detail} | {x.tasks} |" for x in LESSONS]
    return "\n".join(rows)


def docs_markdown() -> str:
    """docs/course.md's section: the lessons as lesson 00 lists them, linked from docs/, with their tasks."""
    rows = [DOCS_HEADING, "", "| # | lesson | what you run and see | graded tasks |", "|---|---|---|---|"]
    rows += [f"| {x.number} | [{x.title}](../lessons/{x.notebook}) | {x.line} | {', '.join(x.task_ids) or '—'} |"
             for x in LESSONS]
    return "\n".join(rows)


def _tour_cell(notebook: dict) -> dict:
    return next(c for c in notebook["cells"] if c.get("id") == MAP_CELL)


def problems() -> list[str]:
    """Where a reader differs from the table (empty when all agree; docs/course.md only once it has the section)."""
    found = []
    cell = "".join(_tour_cell(json.loads(TOUR.read_text(encoding="utf-8")))["source"])
    if cell != map_markdown():
        found.append(f"{TOUR.name}: the map cell ({MAP_CELL}) is not map_markdown(): run python -m pipelab.course.course_map")
    if readme_table() not in README.read_text(encoding="utf-8"):
        found.append("README.md: the course table is not readme_table(): run python -m pipelab.course.course_map")
    docs = DOCS.read_text(encoding="utf-8") if DOCS.is_file() else ""
    if DOCS_HEADING in docs and docs_markdown() not in docs:
        found.append(f"docs/course.md: its {DOCS_HEADING!r} section is not docs_markdown()")
    return found


def write() -> list[Path]:
    """Rewrite lesson 00's map cell and the README's course table from `LESSONS` (docs/course.md is not touched:
    `docs_markdown()` prints what its section says)."""
    notebook = json.loads(TOUR.read_text(encoding="utf-8"))
    _tour_cell(notebook)["source"] = map_markdown().splitlines(keepends=True)
    TOUR.write_text(json.dumps(notebook, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    text = README.read_text(encoding="utf-8")
    start = text.index("| lesson | what you run and see | graded tasks |")
    end = text.index("\n\n", start)
    README.write_text(text[:start] + readme_table() + text[end:], encoding="utf-8")
    return [TOUR, README]


if __name__ == "__main__":
    for path in write():
        print("wrote", path)
    print(f"\ndocs/course.md's section (not written here):\n\n{docs_markdown()}")
