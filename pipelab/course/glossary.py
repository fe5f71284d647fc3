"""Lesson 99, the glossary: every term of the course in English and 繁體中文, from one table.

`TOPICS` is the table: per topic, `Term`s of an English term, its Traditional Chinese, a sentence
or two of meaning and where the course runs it (`Where`: a lesson, and a heading of it).  The
source text's own words are marked: `source` is the wording the text uses (the Chinese term
itself, or "micro-batch", which the text leaves in English).  Everything else is generated:

    python -m pipelab.course.glossary      # rewrites lessons/99_glossary.ipynb from TOPICS

`notebook()` is that notebook as nbformat JSON (a dict), so a test compares it with the committed
file; `broken_links()` checks that every lesson and heading a term names exists.

Links go to a heading as JupyterLab numbers it: a rendered heading's id is its text with every
space replaced by "-" (`createHeaderId` in @jupyterlab/rendermime: textContent.replace(/ /g, "-")),
case and punctuation kept.  A heading whose id a browser would percent-encode (non-ASCII such as
"·" or "≥"), or that JupyterLab would read as a key=value fragment ("="), or whose parentheses or
"?" could end a markdown link early, is linked as its notebook file, with the section named in
the link text ("02 §3").  A lesson that does not exist yet (lesson 13 while it is being written)
is named, not linked, until the notebook is regenerated after it lands.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
LESSONS = ROOT / "lessons"
NOTEBOOK = LESSONS / "99_glossary.ipynb"

NOTEBOOKS = {
    "00": "00_tour.ipynb", "01": "01_splitting.ipynb", "02": "02_microbatches.ipynb", "03": "03_gpipe.ipynb",
    "04": "04_1f1b_memory.ipynb", "05": "05_checkpointing.ipynb", "06": "06_one_process_to_many.ipynb",
    "07": "07_pipelining_is_not_free.ipynb", "08": "08_pp_and_tp_can_be_mixed.ipynb",
    "09": "09_deeper_is_not_better.ipynb", "10": "10_pipedream_async.ipynb", "11": "11_beyond_1f1b.ipynb",
    "12": "12_your_model.ipynb", "13": "13_where_it_is_used.ipynb", "14": "14_capstone.ipynb",
}
SAFE_ANCHOR = re.compile(r"[A-Za-z0-9 .,:;'+-]+")  # what survives a URL and a markdown link unchanged


class Where(NamedTuple):
    """A place the course runs a term: a lesson ("04") and one of its headings, as written ("" = the lesson)."""

    lesson: str
    section: str = ""

    @property
    def notebook(self) -> str:
        return NOTEBOOKS[self.lesson]

    @property
    def anchor(self) -> str:
        """The heading's id in JupyterLab (spaces to "-"), or "" when the link goes to the file only."""
        return self.section.replace(" ", "-") if SAFE_ANCHOR.fullmatch(self.section) else ""

    def label(self) -> str:
        """"04 §2" for a numbered heading, "00 · The timeline" for another, "04" for the whole lesson."""
        number = re.match(r"(\d+)\s*[.·]", self.section)
        if number:
            return f"{self.lesson} §{number.group(1)}"
        return f"{self.lesson} · {self.section}" if self.section else self.lesson

    def markdown(self, lessons: Path = LESSONS) -> str:
        """A link to the heading (its full text as the link's title), or, for a lesson not written yet, its name."""
        if not (lessons / self.notebook).exists():
            return f"{self.label()} (to come)"
        target = f"{self.notebook}#{self.anchor}" if self.anchor else self.notebook
        title = ' "{}"'.format(self.section.replace('"', '\\"')) if self.section else ""
        return f"[{self.label()}]({target}{title})"


class Term(NamedTuple):
    english: str
    chinese: str
    meaning: str          # one or two sentences, formulas where they define the term
    where: tuple[Where, ...]
    source: str = ""      # the source text's own wording of the term, when it uses it
    task: str = ""        # the graded task that has the learner write it


def term(english: str, chinese: str, meaning: str, *where: str, source: str | bool = "", task: str = "") -> Term:
    """A row, written compactly: each `where` is "04" or "04 2. GPipe and 1F1B, side by side";
    source=True: the Chinese term is the source text's own wording."""
    places = tuple(Where(w[:2], w[3:]) for w in where)
    return Term(english, chinese, meaning, places, chinese if source is True else source or "", task)


TOPICS: tuple[tuple[str, tuple[Term, ...]], ...] = (
    ("The idea and its relatives · 流水線並行與相關技術", (
        term("pipeline parallelism", "流水線並行",
             "Consecutive groups of a model's layers go to different devices, and micro-batches stream through "
             "them, so the devices work at the same time on different micro-batches.",
             "00 One pipelined step", "01 1. The course text's example: 8 layers on 4 GPUs", source=True),
        term("layer-wise partitioning", "層級分割",
             "Cutting a model between layers into p contiguous stages, one per device. With many micro-batches "
             "the slowest stage sets the pace, so the best cut has the lightest heaviest stage.",
             "01 2. Unequal blocks: three ways to weigh a block", "01 The slowest stage sets the pace",
             source=True, task="1.1"),
        term("naive model parallelism", "樸素模型並行",
             "Layers on p devices, but the batch sent through as one micro-batch: one device works at a time and "
             "the bubble is 1 − 1/p. Splitting then buys memory, not speed; Hugging Face's device_map=\"auto\" runs "
             "a model this way.",
             "01 3. Naive model parallelism: one device at a time",
             "07 3. The real engine, with 1 and with 8 micro-batches", "13 2. Limited GPUs and fine-tuning"),
        term("model parallelism", "模型並行",
             "Any split of the model itself over devices, as opposed to the data: pipeline parallelism cuts "
             "between layers, tensor parallelism inside them.",
             "08", source=True),
        term("tensor parallelism (TP)", "張量並行",
             "Each weight matrix of a layer is split over t ranks (層內分割, a split inside the layer), which "
             "all-reduce their partial results: 2 all-reduces of b·s·h elements forward and 2 backward per "
             "transformer layer.",
             "08 2. Inside a layer: column- and row-parallel Linears",
             "01 4. The text's advantages: why pipelines suit deep models", source=True, task="4.2"),
        term("data parallelism (DP)", "數據並行",
             "d replicas of the whole (perhaps pipelined) model each take B/d of the batch and all-reduce their "
             "gradients once per step, Ψ parameters' worth per rank.",
             "08 3. Two kinds at a time, on 4 processes", source=True),
        term("hybrid (3D) parallelism", "混合並行",
             "Data, pipeline and tensor parallelism at once on a dp × pp × tp mesh, e.g. BLOOM-176B on "
             "8 × 12 × 4 GPUs: TP inside a node, PP across nodes as deep as memory needs, DP for the rest.",
             "08 5. All three at once, on 8 processes", "08 6. The rule that picks a layout",
             "08 7. Layouts of real runs", source=True),
        term("distributed training", "分佈式訓練",
             "Training one model on several devices whose processes exchange tensors; pipelab's distributed "
             "engine runs one stage per process over torch.distributed (gloo on CPUs, NCCL on GPUs).",
             "06 1. One process per stage", source=True),
        term("device", "設備",
             "A GPU, or the CPU, that runs stages; the course text's example puts 8 layers on 4 GPU devices.",
             "00 CPU or GPU: where the times come from", "01 1. The course text's example: 8 layers on 4 GPUs",
             source=True),
        term("GPU utilisation", "計算利用率",
             "The share of a device's time spent computing, 1 − bubble fraction; raising it is why the batch is "
             "cut into micro-batches.",
             "00 The timeline", "03 1. The text's time steps on a grid", source=True),
    )),
    ("Micro-batches and gradients · 微批次與梯度", (
        term("batch (minibatch)", "批次",
             "The samples of one training step: the optimizer updates the weights once per batch. The global "
             "batch B is the batch over all data-parallel replicas.",
             "02 1 · Splitting a batch, and merging it back", source="batch"),
        term("micro-batch", "微批次",
             "One of the m pieces a batch is cut into (sizes differ by at most one, larger first): the unit of "
             "work that flows through the pipeline. The course text keeps the English word.",
             "02 1 · Splitting a batch, and merging it back", "03 2. The bubble formula",
             source="micro-batch", task="1.2"),
        term("forward pass", "前向傳播",
             "A stage computes its output from its input (action F) and sends that activation to the next stage; "
             "autograd saves what the backward will need.",
             "03 1. The text's time steps on a grid", "06 1. One process per stage", source=True),
        term("backward pass", "反向傳播",
             "A stage turns the gradient of its output into the gradients of its input (sent to the previous "
             "stage) and of its weights (action B, about twice a forward); the last stage goes first.",
             "02 3 · Pipelined gradients equal single-device gradients",
             "03 The same step on a clock: three phases, twice", source=True, task="1.3"),
        term("gradient accumulation", "梯度累積",
             "Adding every micro-batch's gradient into .grad, so that the step applies their sum; exact when "
             "micro-batch i's mean loss is weighted by n_i/N.",
             "02 2 · Why accumulation works: weight each micro-batch by its size", source=True, task="1.3"),
        term("gradient synchronisation", "梯度同步",
             "Making every stage's gradients right before the one update: the n_i/N weights, a global norm "
             "clip that adds the stages' squared norms (‖g‖² = Σ_s ‖g_s‖²), and shared weights such as a tied "
             "embedding.",
             "02 5 · \"Complex gradient synchronisation\", across stages",
             "12 3. The tied embedding: one weight, two stages", source=True),
        term("activations", "激活值",
             "The outputs a layer computes in the forward pass. At a stage boundary they are the message sent "
             "on: b·s·h elements per micro-batch for a transformer of width h.",
             "04 1. What autograd keeps for one micro-batch", "06 1. One process per stage", source=True),
        term("intermediate (saved) activations", "中間激活值",
             "The tensors autograd saves in a forward for its backward, such as each Linear's input; a stage "
             "holds them from a micro-batch's F until its B.",
             "04 1. What autograd keeps for one micro-batch", source=True, task="3.2"),
        term("the plain step (single-device reference)", "單裝置參考步驟",
             "The same model's ordinary step on the whole batch on one device. A correct pipeline gives its loss "
             "and gradients to float rounding, which the lessons check.",
             "00 One pipelined step", "02 3 · Pipelined gradients equal single-device gradients",
             "12 2. Pipelined, against the plain step"),
    )),
    ("Schedules · 排程", (
        term("schedule (schedule as data)", "排程",
             "Each device's ordered list of actions for one step. In pipelab a schedule is a table that the "
             "simulator, both engines and the plots read; Schedule.to_text() draws it on a grid.",
             "00 The schedule is data"),
        term("action (2F0)", "動作",
             "One entry of a schedule: stage, kind (F forward, B backward, I and W the halves of a split "
             "backward, E forward only) and micro-batch, printed as 2F0 for stage 2, forward, micro-batch 0.",
             "00 The schedule is data"),
        term("stage", "流水線階段",
             "A contiguous slice of the model run by one device; a micro-batch crosses the p − 1 stage "
             "boundaries once each way. Interleaved schedules put several (virtual) stages on a device.",
             "01 1. The course text's example: 8 layers on 4 GPUs"),
        term("rank", "行程編號（rank）",
             "The number of one process in a torch.distributed group, 0, 1, …; pipelab runs one stage per rank, "
             "laid out on a (dp, pp, tp) mesh for hybrid layouts.",
             "06 1. One process per stage", "08 1. A mesh of ranks"),
        term("time step", "時間步",
             "One column of a schedule's grid, where every action takes one step; the text's time steps 1, 2, 3 "
             "are columns 0, 1, 2 of GPipe's grid.",
             "03 1. The text's time steps on a grid", source=True),
        term("GPipe", "GPipe",
             "Google's fill-drain schedule (Huang et al. 2019): all m forwards, then all m backwards, then one "
             "update after a flush; every stage keeps all m micro-batches' activations.",
             "03 1. The text's time steps on a grid", "03 2. The bubble formula", source=True, task="2.1"),
        term("fill", "填充",
             "The start of a pass, while the first micro-batch works its way down: device d starts d·t after "
             "device 0 (the drain adds the rest of its idle time).",
             "03 The same step on a clock: three phases, twice", source=True),
        term("steady state", "穩定階段",
             "The middle of a pass, when every device is busy: (m − p + 1)·t per pass in GPipe. In 1F1B each "
             "device alternates one forward and one backward.",
             "03 The same step on a clock: three phases, twice", "04 2. GPipe and 1F1B, side by side"),
        term("drain", "清空",
             "The end of a pass: the last micro-batch leaves and the devices fall idle one after another, device d "
             "(p − 1 − d)·t before the end. Fill and drain together leave each device idle (p − 1)·t per pass.",
             "03 The same step on a clock: three phases, twice", source=True),
        term("flush", "沖刷（flush）",
             "Letting every micro-batch of a step finish before the one weight update, so that all of them use "
             "the same weights: what makes GPipe and 1F1B synchronous.",
             "03 1. The text's time steps on a grid", "10 1. A run without a flush"),
        term("communication synchronisation", "通訊同步",
             "The course text's name for when the backward starts: after the whole batch's forward (GPipe) or at "
             "once, asynchronously (PipeDream). The messages, 2·m·(p − 1) a step, are as many either way.",
             "03 1. The text's time steps on a grid", "10 1. A run without a flush", source=True),
        term("1F1B (PipeDream-Flush)", "1F1B（一前一後）",
             "One forward, one backward: stage s runs min(p − s − 1, m) warm-up forwards, then alternates F and "
             "B, then a cool-down. GPipe's bubble with free links, but at most min(p − s, m) micro-batches in "
             "flight.",
             "04 2. GPipe and 1F1B, side by side", task="3.1"),
        term("warm-up", "預熱階段",
             "1F1B's first forwards on stage s, min(p − s − 1, m) of them, before its first backward; extra "
             "warm-up forwards hide link latency at the price of memory.",
             "04 2. GPipe and 1F1B, side by side", "04 When links are not free"),
        term("cool-down", "收尾階段",
             "1F1B's last part on a stage: the backwards left once it has no forward to run.",
             "04 2. GPipe and 1F1B, side by side"),
        term("in-flight micro-batches", "在途微批次",
             "Micro-batches whose forward has started on a stage and whose backward has not ended, so their "
             "activations are held: at most m per stage under GPipe, min(p − s, m) on stage s under 1F1B.",
             "04 2. GPipe and 1F1B, side by side", "04 3. Run for real: memory over time", task="3.2"),
        term("interleaved 1F1B (virtual stages)", "交錯式 1F1B（虛擬階段）",
             "Each device holds v model chunks (stage k on device k mod p): the bubble falls to (p − 1)/(v·m) of "
             "the ideal time, for 2·m·(p·v − 1) messages, more activations on device 0, and m a multiple of p.",
             "11 1. Interleaved 1F1B: virtual stages", "11 4. Interleaving for real", task="5.1"),
        term("split backward (I and W)", "拆分反向傳播（I 與 W）",
             "A backward done as two actions: I, the gradient of the stage's input, which the previous stage "
             "waits for (the Zero Bubble paper's B), and W, the gradient of its weights, which only the optimizer "
             "needs. Together they give one backward's gradients bit for bit.",
             "11 2. Zero bubble: split the backward into I and W"),
        term("zero bubble (ZB-H1)", "零氣泡（ZB-H1）",
             "1F1B's order with split backwards, the W's deferred into 1F1B's idle slots (Qi et al. 2024): "
             "(p − 1)(T_F + T_B − T_W) idle per stage against 1F1B's (p − 1)(T_F + T_B + T_W), at 1F1B's peak "
             "memory. ZB-H2 idles (p − 1)(T_F + T_B − 2T_W) at (2p − 1) micro-batches.",
             "11 2. Zero bubble: split the backward into I and W", task="5.3"),
        term("schedule search", "排程搜尋",
             "pl.search_schedule: a schedule found rather than written, the shortest simulated makespan it can "
             "find with each device under a memory limit; never worse than a named schedule that fits.",
             "14 3. A schedule for a memory limit"),
        term("DualPipe", "DualPipe",
             "DeepSeek-V3's schedule: two pipelines in opposite directions over the same devices, one "
             "direction's forward overlapped with the other's backward to hide communication; bubble "
             "(PP/2 − 1)(F&B + B − 3W) with twice the parameters (a statement: its README).",
             "11 5. The next step: DualPipe (a statement)"),
        term("PipeDream", "PipeDream",
             "Narayanan et al., SOSP 2019, from Microsoft Research with Stanford and CMU (the course text calls "
             "it Google's): 1F1B without a flush, each stage updating after each backward, with weight stashing.",
             "10 1. A run without a flush", "10 5. Where it went", source=True),
        term("asynchronous pipeline (no flush)", "異步",
             "Stages update their weights without waiting for the rest of a batch: fill and drain are paid once "
             "per run instead of once per step, but gradients are computed on stale weights.",
             "10 1. A run without a flush", "10 4. Training: synchronous against asynchronous", source=True),
        term("weight stashing", "權重暫存",
             "A forward keeps the weight version it used and its backward uses that version again, so each "
             "gradient is the true gradient of what its forward computed; stage s then holds p − s versions.",
             "10 2. Weight versions, and how stale they are", "10 3. What stashing costs in memory", task="5.2"),
        term("staleness", "陳舊度",
             "How many updates a stage made between a micro-batch's forward and the update its gradient makes: "
             "p − s − 1 on stage s under asynchronous PipeDream, 0 with a flush.",
             "10 2. Weight versions, and how stale they are"),
        term("PipeDream-2BW", "PipeDream-2BW",
             "Narayanan et al., ICML 2021: two weight versions whatever p, by accumulating over m ≥ p "
             "micro-batches and applying each update one step late. The BERT and GPT results the course text "
             "credits to PipeDream are its.",
             "10 3. What stashing costs in memory"),
        term("deadlock", "死結",
             "A schedule in which an action waits, directly or around a cycle, for one that can only run after "
             "it; pl.schedules.validate refuses it and says which action waits for what.",
             "02 3 · Pipelined gradients equal single-device gradients",
             "11 3. PyTorch's own tables, read and checked"),
        term("PyTorch's schedule tables", "PyTorch 排程表",
             "torch.distributed.pipelining's pipeline_order, {rank: action or None per time step}; pipelab reads "
             "it as a Schedule and validates it (torch 2.13's Schedule1F1B table skips F0 on the last rank).",
             "11 3. PyTorch's own tables, read and checked"),
    )),
    ("Bubble, time and speed · 氣泡、時間與加速", (
        term("bubble", "氣泡",
             "Idle time of a device inside a step, mostly while the pipeline fills and drains; the course text's "
             "氣泡開銷, bubble overhead.",
             "00 The timeline", "03 2. The bubble formula", source=True),
        term("bubble fraction", "氣泡比例",
             "The idle share of a step, 1 − Σ busy / (p · makespan): (p − 1)/(m + p − 1) for GPipe and 1F1B with "
             "p equal stages and free links, or (p − 1)/m of the ideal time m·(t_F + t_B).",
             "03 2. The bubble formula", "03 3. Formula vs measurement", source=True, task="2.2"),
        term("makespan", "完工時間（makespan）",
             "A step's length on the timeline, from the first action's start to the last one's end; "
             "(m + p − 1)(t_F + t_B) for GPipe with equal stages and free links.",
             "00 The timeline", "03 The same step on a clock: three phases, twice"),
        term("speed-up", "加速比",
             "S = T₁/T_p, the time of one device doing all the work over the pipeline's makespan: "
             "p·(1 − bubble) = p·m/(m + p − 1) for GPipe and 1F1B with equal stages and free links.",
             "07 1. Speed-up, defined", "06 4. The real speed-up", source="加速效果"),
        term("the m ≥ 4p rule", "m ≥ 4p 經驗法則",
             "GPipe's rule of thumb: with at least 4 micro-batches per stage the bubble is negligible; the "
             "formula still leaves (p − 1)/(5p − 1), just under 20 %.",
             "07 4. How many micro-batches are enough? The m ≥ 4p rule"),
        term("per-micro-batch overhead", "微批次的固定開銷",
             "Every action's fixed cost and the lower efficiency of small matrix products: m small micro-batches "
             "are more work than one batch, a cost the bubble formula leaves out.",
             "07 A second cost the bubble formula leaves out"),
        term("pipeline depth", "流水線深度",
             "The number of stages p. Deeper is not better: at a fixed m the bubble grows with p, every boundary "
             "adds messages, and stage 0's activations do not shrink.",
             "09 1. The experiment: one model, one batch, five depths",
             "09 2. Why the deepest pipeline loses: the step, taken apart", source=True),
        term("memory pressure", "記憶體壓力",
             "Memory near a device's limit. Under 1F1B stage 0 holds min(p, m) micro-batches of 1/p of the "
             "model, so a deeper pipeline does not relieve it.",
             "09 3. Memory: stage 0 does not get lighter", source=True),
        term("throughput", "吞吐量",
             "Work per second: samples or micro-batches per second over a step, what more devices should raise "
             "and a too-deep pipeline does not.",
             "09 1. The experiment: one model, one batch, five depths", "13 4. Edge inference"),
        term("link latency", "通訊延遲",
             "The fixed time of a message (one costs latency + bytes / bandwidth): GPipe pays 2(p − 1)·latency "
             "per step, 1F1B more, as its steady state waits for gradient round trips.",
             "04 When links are not free", "07 Communication makes it worse"),
        term("communication bandwidth", "通訊帶寬",
             "The bytes per second a link carries. A pipeline needs little, the course text's first advantage: "
             "it sends only boundary activations and their gradients, whatever the depth.",
             "09 The link between stages", "13 5. Two hosts over a slow link", source=True),
        term("communication volume", "通訊量",
             "The bytes a kind of parallelism moves: PP b·s·h per boundary and micro-batch each way, TP four "
             "all-reduces of b·s·h per layer, DP an all-reduce of the gradients per step.",
             "01 4. The text's advantages: why pipelines suit deep models",
             "08 3. Two kinds at a time, on 4 processes", source=True),
        term("layer boundary (stage boundary)", "層邊界",
             "Where one stage ends and the next begins, the only place a pipeline communicates; with tensor "
             "parallelism each TP rank sends a 1/t slice across it.",
             "01 4. The text's advantages: why pipelines suit deep models",
             "08 2. Inside a layer: column- and row-parallel Linears", source=True),
    )),
    ("Memory · 記憶體", (
        term("activation memory", "激活記憶體",
             "What a stage holds for its pending backwards, in-flight micro-batches × bytes each: m·M per stage "
             "under GPipe, min(p − s, m)·M on stage s under 1F1B.",
             "04 3. Run for real: memory over time", "04 4. More micro-batches, and what the saving costs"),
        term("counted vs observed memory", "計數與實測記憶體",
             "Counted: the bytes autograd saves, added at F and released at B by a rule, as the simulator "
             "predicts. Observed: when PyTorch really frees each storage, which also sees outputs until sent and "
             "messages waiting, and is never below the count.",
             "04 3. Run for real: memory over time", "05 3. How much memory"),
        term("activation checkpointing", "激活檢查點",
             "A stage's forward keeps only its input and its backward recomputes the forward first: activations "
             "shrink to inputs, and each B costs one forward more (+33 % at t_B = 2·t_F; Chen et al. 2016: about "
             "30 %).",
             "05 1. The idea: keep the input, redo the forward", "05 4. How much time", source=True),
        term("memory budget", "記憶體預算",
             "The bytes a device may hold: pipelab adds its parameters, gradients, optimizer state, activations "
             "and stashed weights, and refuses a step that would not fit (MemoryBudgetError).",
             "04 5. Try it: a memory budget", "05 5. What it enables: more under the same budget",
             "13 2. Limited GPUs and fine-tuning"),
        term("training state", "訓練狀態",
             "What a device holds besides activations: parameters, gradients and optimizer state, about 16 bytes "
             "per parameter with mixed-precision Adam (ZeRO §3); pipeline and tensor parallelism divide it by p "
             "and t, ZeRO-3 (FSDP) by d.",
             "13 1. Very large models", "01 4. The text's advantages: why pipelines suit deep models",
             "08 9. Pipeline it, or shard it?", "14 Sharding beside pipelining"),
        term("ZeRO and fully sharded data parallelism (FSDP)", "ZeRO 與全分片數據並行（FSDP）",
             "Data-parallel ranks that shard the model state instead of each keeping all of it (Rajbhandari et "
             "al. 2020): ZeRO-1 the optimizer state, ZeRO-2 the gradients too, ZeRO-3 (FSDP) the parameters too, "
             "16Ψ/d a device. Pipelines combine easily with ZeRO-1 only: sharded gradients would be "
             "reduce-scattered once per micro-batch, not once per step (pipelab's FSDP2 stages hold full "
             "gradients until one reduce-scatter).",
             "08 9. Pipeline it, or shard it?", "14 Sharding beside pipelining"),
        term("activations of a transformer layer", "每層激活值（Korthikanti 公式）",
             "What one layer keeps for its backward at 16 bits (Korthikanti et al. 2022): sbh·(34 + 5as/h) bytes; "
             "under t-way tensor parallelism sbh·(10 + 24/t + 5as/(ht)), the 10 (layer norms, their outputs, two "
             "dropout masks) whole on every rank.",
             "08 4. What TP does to activations: Korthikanti's count", "14 1. The plan"),
        term("sequence parallelism", "序列並行",
             "Splitting a tensor-parallel layer's layer norms and dropouts along the sequence over the t ranks "
             "(Korthikanti et al. 2022, §4.2.2): a layer's activations fall to sbh·(34/t + 5as/(ht)). Named, not "
             "run, in this course.",
             "08 4. What TP does to activations: Korthikanti's count"),
    )),
    ("Running and measuring · 執行與量測", (
        term("trace", "追蹤記錄（trace）",
             "What a step leaves behind (pl.Trace): every action's start and end on every device, memory "
             "samples, messages and waits; it exports to Perfetto in the Chrome trace format.",
             "00 A trace for Perfetto", "00 The timeline"),
        term("timeline", "時間軸",
             "A trace drawn one row per device, forwards blue, backwards orange, idle hatched (pl.plot.timeline).",
             "00 The timeline"),
        term("replayed vs measured", "重播與實測",
             "Measured: one device per stage, each action timed where it ran. Replayed: stages sharing a device "
             "run one op at a time, and the op times are replayed on one clock per stage.",
             "00 CPU or GPU: where the times come from", "06 2. The same step, three ways"),
        term("simulator (prediction)", "模擬器",
             "pl.simulate runs a schedule on a cost model (pl.Costs: t_F, t_B, bytes, latency) without tensors: "
             "each action starts when its device is free and its inputs have arrived.",
             "03 The same step on a clock: three phases, twice", "03 3. Formula vs measurement", task="2.3"),
        term("profile", "效能剖析",
             "Timing each stage's forward and backward on one micro-batch, fastest of several runs "
             "(pl.Costs.from_profile), to give the simulator a real model's costs.",
             "03 3. Formula vs measurement"),
        term("explorer", "探索器",
             "pl.widgets.explorer(): sliders for p, m, the schedule, t_B/t_F, latency, checkpointing and a "
             "memory budget over the simulator, with the bubble beside its formula.",
             "03 4. Explore: the bubble under your fingers", "00 The explorer"),
        term("local and distributed engines", "本地引擎與分佈式引擎",
             "pl.Pipeline runs every stage in one process, handing tensors over in memory; pl.DistributedPipeline "
             "runs one stage per process over torch.distributed. Both run the same loop over a device's actions.",
             "06 1. One process per stage", "06 2. The same step, three ways"),
        term("point-to-point communication", "點對點通訊",
             "One rank sends a tensor to one other (isend / irecv): activations forward to the next stage's rank, "
             "gradients back to the previous one, one tag per micro-batch.",
             "06 1. One process per stage", task="4.1"),
        term("wait", "等待",
             "Time a rank spends receiving because the message its next action needs has not arrived; its cause "
             "is always on another rank.",
             "06 3. Why a rank waited"),
        term("torchrun and rendezvous", "torchrun 與會合（rendezvous）",
             "PyTorch's launcher starts the processes, gives each its RANK and WORLD_SIZE and lets them find each "
             "other at a rendezvous endpoint; on two machines the same command with --node-rank 0 and 1.",
             "06 5. The same pipeline on two machines"),
        term("graded task", "評分練習",
             "A piece of the engine you write yourself in exercises/; `pipelab grade 1.1` grades one, with "
             "hints, and `pipelab grade` all of them.",
             "00 Your graded tasks"),
    )),
    ("Tensor parallelism and layouts · 張量並行與佈局", (
        term("column-parallel linear", "欄並行線性層",
             "A Linear Y = X·A with A split by output columns over t ranks: each computes its slice from the "
             "whole X without communicating, and the input gradient is the sum of the ranks' parts.",
             "08 2. Inside a layer: column- and row-parallel Linears", task="4.2"),
        term("row-parallel linear", "列並行線性層",
             "A Linear with A split by input rows and X split alike: each rank computes a partial sum X_r·A_r, "
             "and Y is their all-reduce.",
             "08 2. Inside a layer: column- and row-parallel Linears", task="4.2"),
        term("f and g (Megatron-LM)", "f 與 g 運算子",
             "The two communications of tensor parallelism: f before a column-parallel layer (identity forward, "
             "all-reduce of the gradient backward), g after a row-parallel one (all-reduce forward, identity "
             "backward).",
             "08 2. Inside a layer: column- and row-parallel Linears"),
        term("all-reduce", "全歸約（all-reduce）",
             "Every rank ends with the sum of every rank's tensor; a ring all-reduce of N bytes puts 2(t − 1)/t·N "
             "on the wire per rank. TP's f and g, DP's gradient sync and a tied embedding's sync are all-reduces.",
             "08 2. Inside a layer: column- and row-parallel Linears", "08 3. Two kinds at a time, on 4 processes"),
        term("scatter/gather at a stage boundary", "階段邊界的分散與聚集",
             "With tensor parallelism each TP rank sends only its 1/t slice of the boundary activation to its "
             "peer on the next stage, where an all-gather over tp rebuilds it (Megatron-LM SC21 §4.1).",
             "08 2. Inside a layer: column- and row-parallel Linears", "08 3. Two kinds at a time, on 4 processes"),
        term("DeviceMesh layout", "裝置網格佈局（DeviceMesh）",
             "pl.Layout(dp, pp, tp) orders dp·pp·tp ranks as PyTorch's init_device_mesh does, tp innermost, so a "
             "TP group's ranks are neighbours: the GPUs of one node.",
             "08 1. A mesh of ranks"),
        term("global batch", "全域批次",
             "The batch B over all replicas, fixed by the optimisation; with micro-batch b and d replicas "
             "m = B/(b·d), so the bubble is (p − 1)·b·d/B of the ideal time.",
             "08 6. The rule that picks a layout", "14 1. The plan"),
        term("layout planner", "佈局規劃器",
             "pl.plan: every (dp, pp, tp) with dp·pp·tp = devices, each schedule and recomputation, ranked by "
             "predicted step time, with memory per device and bytes per kind; those over the memory limit are "
             "listed apart with the reason.",
             "14 1. The plan", "14 2. Run it, scaled down", task="7.1"),
    )),
    ("Your own model · 你自己的模型", (
        term("split points", "切分點",
             "The names of the modules where stages begin, e.g. transformer.h.3: pipelab traces the model's own "
             "forward and cuts there, and every parameter keeps its name.",
             "12 1. A GPT-2 from a config", "12 2. Pipelined, against the plain step"),
        term("tied embedding", "綁定嵌入（共享權重）",
             "One weight used by the input embedding on the first stage and the output layer on the last: in one "
             "process autograd adds both uses; across processes the two ranks all-reduce its gradient.",
             "12 3. The tied embedding: one weight, two stages"),
        term("token-normalised loss", "依詞元數正規化的損失",
             "Micro-batch i weighted by c_i/C, its share of the counted (unpadded) tokens, so that the pipelined "
             "loss is the model's own mean over tokens; weighting by samples, n_i/N, is not when rows are padded.",
             "12 4. Padding: weigh micro-batches by samples or by tokens?", task="6.1"),
        term("BatchNorm and micro-batches", "批次正規化與微批次",
             "In train mode BatchNorm normalises over its input, in a pipeline one micro-batch: m forwards of N/m "
             "samples rather than one of N, so statistics and gradients differ and pipelab warns.",
             "12 5. BatchNorm sees one micro-batch at a time"),
        term("dynamic padding", "動態填充",
             "Each batch padded to its own longest row, so a training run's batches change shape from step to step "
             "(and an epoch's last batch is short); a pipeline split by names follows with a trace of dynamic "
             "dimensions, every step still the single device's.",
             "12 7. A training run over a loader"),
    )),
    ("Where it is used · 實際應用", (
        term("forward-only (inference) schedule", "僅前向排程（推理）",
             "Each micro-batch goes through every stage once and nothing is kept (action E): its service time "
             "inside the pipeline is p·t whatever m, the throughput m/((m + p − 1)·t).",
             "13 4. Edge inference", task="6.2"),
        term("edge inference", "邊緣推理",
             "The course text's use: a model split over several edge devices (分佈式推理, distributed inference) "
             "so that it fits; the pipeline does not shorten a request's service time, p·t, but raises throughput, "
             "so requests that arrive together wait less.",
             "13 4. Edge inference", source=True),
        term("latency and service time", "延遲與服務時間",
             "Service time: a request's time inside the pipeline, p·t on p stages of t each, whatever m. Latency: "
             "from its arrival to its answer, waiting included: of requests that arrive together, the i-th "
             "leaves at (i + p)·t on the pipeline against (i + 1)·p·t on one device; an edge pipeline adds "
             "(p − 1) link times.",
             "13 4. Edge inference", task="6.2"),
        term("KV cache lanes", "KV 快取通道",
             "Pipelined generation keeps m groups of sequences (lanes) in flight, each with its own key/value "
             "cache on every stage (pipe.generate(..., lanes=m)), so that with m ≥ p lanes every stage has a "
             "token to work on.",
             "13 4. Edge inference"),
        term("restage (dynamic pipeline depth)", "動態調整流水線深度",
             "Changing the number of stages between two steps as devices come or go (Pipeline.restage): the same "
             "parameters and optimizer go on, so the loss curve continues unbroken.",
             "13 3. The cloud: depth that changes mid-run", source=True),
        term("multi-tenant cloud", "多租戶",
             "Many users' jobs sharing one cluster, so the devices a job gets can change: the course text's "
             "reason to adjust the pipeline depth at run time.",
             "13 3. The cloud: depth that changes mid-run", source="多租户"),
        term("limited GPU resources", "有限的 GPU 資源",
             "The course text's case of a model larger than one device's memory: split into stages, it trains on "
             "several small GPUs without a large cluster. (The text calls the setting 邊界計算, literally "
             "\"boundary computing\".)",
             "13 2. Limited GPUs and fine-tuning", source=True),
        term("fine-tuning", "微調",
             "Training a pretrained model further on a new task; the course text's use: fine-tuning a very large "
             "model on a few GPUs by splitting it into stages. Lesson 13 fine-tunes a GPT pretrained on Python's "
             "docstrings on the Zen of Python.",
             "13 2. Limited GPUs and fine-tuning", source=True),
        term("frozen layers", "凍結層",
             "Layers left out of training (requires_grad_(False)): their activations still flow forward, but they "
             "get no gradient and no optimizer state, so their stage holds only its parameters.",
             "13 2. Limited GPUs and fine-tuning"),
    )),
)

TERMS: tuple[Term, ...] = tuple(t for _, terms in TOPICS for t in terms)


# --- rendering -------------------------------------------------------------------------------------------------


def _chinese(t: Term) -> str:
    if t.source == t.chinese:
        return f"**{t.chinese}**"
    if t.source:
        return f"{t.chinese} (text: **{t.source}**)"
    return t.chinese


def table(terms=TERMS, lessons: Path = LESSONS) -> str:
    """The terms as one markdown table: English, 繁體中文, meaning, where it runs (links) and its graded task."""
    rows = ["| English | 繁體中文 | what it means | runs in |", "|---|---|---|---|"]
    for t in terms:
        places = ", ".join(w.markdown(lessons) for w in t.where)
        if t.task:
            places += f"; task {t.task}"
        rows.append(f"| **{t.english}** | {_chinese(t)} | {t.meaning} | {places} |")
    return "\n".join(rows)


def find(text: str, terms=TERMS) -> list[Term]:
    """The terms whose English, Chinese, source wording or meaning contains `text` (any case); all for ""."""
    needle = text.strip().casefold()
    return [t for t in terms if needle in f"{t.english} {t.chinese} {t.source} {t.meaning}".casefold()]


INTRO = """# 99 · Glossary: English and 繁體中文

Every term of the course and of its source text (流水線並行（Pipeline Parallelism）是什麼？), in English and in
Traditional Chinese, with what it means in a sentence or two and the lesson sections that run it. A **bold**
Chinese term is the source text's own wording (it writes *micro-batch* in English, so 微批次 is marked as the
text's "micro-batch"); the others are standard Traditional Chinese renderings. In the last column, `04 §2` links
to section 2 of lesson 04 (hover a link for the heading; a lesson JupyterLab had not opened yet opens at its top,
and a second click lands on the heading), and `task 3.1` names the graded task that has you write it. Type a word
in either language into the search box below to see only the rows that mention it. Everything here is generated
from one table, `TOPICS` in `pipelab/course/glossary.py` (`python -m pipelab.course.glossary` rewrites this
notebook), and a test checks that every link lands on a lesson and one of its headings."""

CODE = """import ipywidgets as widgets
from IPython.display import Markdown, display

import pipelab.course.glossary as glossary

problems = glossary.broken_links()
assert not problems, "\\n".join(problems)
assert [t.english for t in glossary.find("氣泡比例")] == ["bubble fraction"]
print(f"{len(glossary.TERMS)} terms in {len(glossary.TOPICS)} topics; every lesson and heading they name exists")


def show(text=""):
    found = glossary.find(text) if text.strip() else []
    display(Markdown(glossary.table(found) if found else "(type a word: bubble, 氣泡, 1F1B, …)"))


search = widgets.interactive(show, text=widgets.Text(description="search", placeholder="bubble, 氣泡, 1F1B, …"))
search"""

MEASURED = """## What you measured

Nothing new: every term was measured in the lesson its row links to. The cell at the top checked, as it ran, that
each of the {n} terms has both languages and a place in the course, and that every lesson and heading it names
exists.

## Your graded tasks

The `task` entries above are the course's graded tasks. Run `pipelab grade` for a report on all of them (with hints
naming the file in `exercises/` to edit), `pipelab grade 3.1` for one, or `python -m pytest -m task3_1 --impl
exercises`."""


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.split("·")[0].lower()).strip("-")


def _cell(cell_type: str, cell_id: str, source: str) -> dict:
    cell = {"cell_type": cell_type, "id": cell_id, "metadata": {}, "source": source.splitlines(keepends=True)}
    if cell_type == "code":
        cell.update(execution_count=None, outputs=[])
        cell = {k: cell[k] for k in ("cell_type", "execution_count", "id", "metadata", "outputs", "source")}
    return cell


def notebook(lessons: Path = LESSONS) -> dict:
    """Lesson 99 as nbformat 4.5 JSON, outputs cleared: what `write()` saves as lessons/99_glossary.ipynb."""
    cells = [_cell("markdown", "glossary-intro", INTRO), _cell("code", "glossary-search", CODE)]
    for topic, terms in TOPICS:
        cells.append(_cell("markdown", f"glossary-{_slug(topic)}", f"## {topic}\n\n{table(terms, lessons)}"))
    cells.append(_cell("markdown", "glossary-measured", MEASURED.format(n=len(TERMS))))
    return {
        "cells": cells,
        "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
                     "language_info": {"name": "python"}},
        "nbformat": 4,
        "nbformat_minor": 5,
    }


def write(path: Path = NOTEBOOK) -> Path:
    """Save `notebook()` (as nbformat writes it: one-space indent, unicode kept, a final newline)."""
    path.write_text(json.dumps(notebook(path.parent), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


# --- checks ----------------------------------------------------------------------------------------------------


def headings(path: Path) -> list[str]:
    """The text of every markdown heading in a notebook, in order (lines starting with #, outside code fences)."""
    found = []
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        fenced = False
        for line in source.splitlines():
            if line.lstrip().startswith(("```", "~~~")):
                fenced = not fenced
            heading = re.match(r" {0,3}#{1,6}\s+(.*?)(\s+#+)?\s*$", line)
            if heading and not fenced:
                found.append(heading.group(1))
    return found


def broken_links(lessons: Path = LESSONS) -> list[str]:
    """Every place a term names that is missing: a lesson file, or a heading of it (a lesson still to come may be
    named without a section).  Empty when all resolve."""
    problems = []
    for t in TERMS:
        if not t.where:
            problems.append(f"{t.english!r}: names no lesson that runs it")
        for w in t.where:
            path = lessons / w.notebook
            if not path.exists():
                if w.section:
                    problems.append(f"{t.english!r}: lessons/{w.notebook} does not exist (yet?), so neither does "
                                    f"its heading {w.section!r}; name the lesson only until it does")
            elif w.section and w.section not in headings(path):
                problems.append(f"{t.english!r}: {w.notebook} has no heading {w.section!r}")
    return problems


if __name__ == "__main__":
    print("wrote", write())
