"""Lesson 99, the glossary: one table (pipelab/course/glossary.py) generates the notebook, every link in it lands
on a lesson and one of its headings, every term appears once in both languages, and the source text's terms are
its own words."""

import json
import re
import unicodedata
from pathlib import Path

import pytest

from pipelab.course import glossary

ROOT = Path(__file__).resolve().parents[1]
LESSONS = ROOT / "lessons"
NOTEBOOK = LESSONS / "99_glossary.ipynb"
SEED = ROOT.parent / "shared" / "seed" / "pipeline-parallelism.zh-Hant.txt"  # ../shared, beside the project
REGENERATE = "regenerate it with `python -m pipelab.course.glossary`"

LINK = re.compile(r'\[([^\]]+)\]\(([^\s)]+)(?:\s+"((?:[^"\\]|\\.)*)")?\)')
# What a browser leaves alone in a fragment and JupyterLab reads as a heading id: no percent-encoding (ASCII, no
# space, quote, <, >, `), no "=" (JupyterLab's key=value fragments), nothing that could end a markdown link.
SAFE_FRAGMENT = re.compile(r"[A-Za-z0-9.,:;'+-]+")


def markdown_of(notebook):
    return "\n".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "markdown")


def jupyterlab_heading_ids(path):
    """The ids JupyterLab gives a notebook's headings: the rendered heading's textContent with each space
    replaced by "-" (@jupyterlab/rendermime, `createHeaderId`: textContent.replace(/ /g, '-')), case kept."""
    ids = set()
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        if cell["cell_type"] != "markdown":
            continue
        fenced = False
        for line in "".join(cell["source"]).splitlines():
            if line.lstrip().startswith(("```", "~~~")):
                fenced = not fenced
            heading = re.match(r" {0,3}#{1,6}\s+(.*?)(\s+#+)?\s*$", line)
            if heading and not fenced:
                text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))  # a link shows its text
                text = re.sub(r"(\*\*|__|\*|`)", "", text)                         # markup shows nothing
                ids.add(text.replace(" ", "-"))
    return ids


def committed():
    return json.loads(NOTEBOOK.read_text(encoding="utf-8"))


def test_the_committed_notebook_is_generated_from_the_table():
    generated, saved = glossary.notebook(), committed()
    differing = [cell["id"] for cell, other in zip(generated["cells"], saved["cells"]) if cell != other]
    lesson_13 = LESSONS / glossary.NOTEBOOKS["13"]
    hint = (f" (lessons/{lesson_13.name} {'exists' if lesson_13.exists() else 'does not exist'} now, and the "
            "glossary links a lesson only while it exists)")
    assert saved == generated, (f"lessons/99_glossary.ipynb is not what glossary.notebook() gives (cells "
                                f"{differing or 'count or metadata'} differ){hint}: {REGENERATE}")


def test_the_notebook_is_the_table():
    text = markdown_of(committed())
    rows = [line for line in text.splitlines() if line.startswith("| **")]
    assert len(rows) == len(glossary.TERMS)
    for t in glossary.TERMS:
        assert f"| **{t.english}** |" in text


def test_every_term_appears_once():
    for language in ("english", "chinese"):
        names = [getattr(t, language).casefold() for t in glossary.TERMS]
        repeated = sorted({n for n in names if names.count(n) > 1})
        assert not repeated, f"{language} terms listed twice: {repeated}"


NAMES = {"GPipe", "PipeDream", "PipeDream-2BW", "DualPipe"}  # names, the same in both languages


def has_han(text):
    return any(unicodedata.name(ch, "").startswith("CJK UNIFIED IDEOGRAPH") for ch in text)


@pytest.mark.parametrize("term", glossary.TERMS, ids=lambda t: t.english)
def test_each_term_has_both_languages_a_meaning_and_a_lesson(term):
    assert term.english.strip() and term.chinese.strip() and term.meaning.strip()
    assert has_han(term.chinese) or term.chinese in NAMES, f"{term.chinese!r} is not Chinese"
    assert not has_han(term.english)
    assert term.where, f"{term.english!r}: no lesson runs it"
    assert 40 <= len(term.meaning) <= 420, "a sentence or two"
    for field in term[:3] + (term.source, term.task):
        assert "|" not in field and "\n" not in field, f"{field!r} would break the markdown table"
    assert term.task == "" or re.fullmatch(r"\d\.\d", term.task)


def test_every_place_a_term_names_exists():
    assert glossary.broken_links() == []


def test_every_link_resolves_to_a_lesson_and_a_heading():
    links = LINK.findall(markdown_of(committed()))
    assert len(links) >= len(glossary.TERMS)
    problems = []
    for text, target, title in links:
        assert not target.startswith(("http:", "https:", "/")), target
        path, _, fragment = target.partition("#")
        if not (LESSONS / path).is_file():
            problems.append(f"[{text}]({target}): no lessons/{path}")
        elif fragment and not SAFE_FRAGMENT.fullmatch(fragment):
            problems.append(f"[{text}]({target}): a browser would change the fragment {fragment!r}")
        elif fragment and fragment not in jupyterlab_heading_ids(LESSONS / path):
            problems.append(f"[{text}]({target}): {path} has no heading with the id {fragment!r}")
        elif not fragment and title:  # a heading linked as its file must still be named in the link's text
            assert "§" in text or title.replace('\\"', '"') in text, (text, title)
    assert not problems, "\n".join(problems) + f"\nfix the `where` of those terms in glossary.py, then {REGENERATE}"


def test_every_existing_lesson_is_linked_and_a_missing_one_named():
    text = markdown_of(committed())
    for t in glossary.TERMS:
        for w in t.where:
            if (LESSONS / w.notebook).exists():
                target = f"{w.notebook}#{w.anchor}" if w.anchor else w.notebook
                assert f"]({target}" in text, f"{t.english!r} does not link {target}"
            else:
                assert f"{w.label()} (to come)" in text


def test_heading_ids_as_jupyterlab_makes_them():
    section = glossary.Where("04", "2. GPipe and 1F1B, side by side")
    assert section.anchor == "2.-GPipe-and-1F1B,-side-by-side" and section.label() == "04 §2"
    assert glossary.Where("00", "The timeline").label() == "00 · The timeline"
    unsafe_headings = ("1 · Splitting a batch, and merging it back", "4. Padding: weigh micro-batches by tokens?",
                       "5. The next step: DualPipe (a statement)", "4. The real engine at p = 4 and p = 16")
    for unsafe in unsafe_headings:
        where = glossary.Where("02", unsafe)
        assert where.anchor == "" and "§" in where.label()
        assert where.markdown().startswith(f"[{where.label()}](02_microbatches.ipynb \"")
    missing = glossary.Where("13")
    assert missing.markdown(ROOT / "no-such-folder") == "13 (to come)"


def test_search_in_either_language():
    assert [t.english for t in glossary.find("氣泡比例")] == ["bubble fraction"]
    assert {"bubble", "bubble fraction"} <= {t.english for t in glossary.find("BUBBLE")}
    assert "micro-batch" in {t.english for t in glossary.find("微批次")}
    assert glossary.find("no such word anywhere") == []
    assert glossary.find("") == list(glossary.TERMS)


# The source text's words.  Its terms, as it writes them, each the `source` of a row (checked against the text).
SOURCE_WORDS = [
    "流水線並行", "batch", "micro-batch", "層級分割", "模型並行", "張量並行", "數據並行", "混合並行", "分佈式訓練", "設備",
    "計算利用率", "前向傳播", "反向傳播", "梯度累積", "梯度同步", "激活值", "中間激活值", "時間步", "GPipe", "填充", "清空",
    "通訊同步", "PipeDream", "異步", "氣泡", "氣泡比例", "加速效果", "流水線深度", "記憶體壓力", "通訊帶寬", "通訊量",
    "層邊界", "激活檢查點", "邊緣推理", "動態調整流水線深度", "多租户", "微調", "有限的 GPU 資源",
]
# The ones issue 26 names, which the glossary gives in the text's own wording.
NAMED = ["流水線並行", "氣泡", "激活檢查點", "張量並行", "數據並行", "混合並行", "梯度累積", "前向傳播", "反向傳播",
         "流水線深度", "通訊同步"]


@pytest.fixture(scope="module")
def seed_text():
    if not SEED.exists():
        pytest.skip(f"the source text is not at {SEED} (../shared/seed beside the project)")
    return SEED.read_text(encoding="utf-8")


def test_every_source_word_is_in_the_text(seed_text):
    missing = [t.source for t in glossary.TERMS if t.source and t.source not in seed_text]
    assert not missing, f"not the source text's wording: {missing}"


def test_the_source_texts_terms_are_all_there(seed_text):
    sources = {t.source for t in glossary.TERMS}
    assert [w for w in SOURCE_WORDS if w not in seed_text] == []
    assert [w for w in SOURCE_WORDS if w not in sources] == []


def test_the_named_terms_are_in_the_texts_own_words(seed_text):
    by_chinese = {t.chinese: t for t in glossary.TERMS}
    for word in NAMED:
        assert word in seed_text and by_chinese[word].source == word, word
    # 微批次 is the course's rendering: the text writes micro-batch in English, and the row says so.
    micro = by_chinese["微批次"]
    assert "微批次" not in seed_text and micro.english == "micro-batch" and micro.source == "micro-batch"
    assert "微批次 (text: **micro-batch**)" in markdown_of(committed())
