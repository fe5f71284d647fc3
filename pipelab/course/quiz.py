"""Predict, then run: a guess typed before a measurement, shown beside it afterwards; a lesson-end quiz.

    guess = pl.quiz.predict("Bubble share of the step for p=4, m=8?", unit="%")
    ...                                   # the run
    guess.reveal(100 * trace.bubble_fraction, explanation="(p-1)/(m+p-1) = 3/11")

    check = pl.quiz.quiz([pl.quiz.Question("...", ["a", "b"], answer=1, why="...")])
    assert all(check.check([1])) and not all(check.check([0]))   # checked in the kernel

The judging is plain functions (`relative_error`, `judge_number`, `judge_choice`), tested
without a frontend; the widgets (ipywidgets, imported on first use) only collect the
learner's input and show the text those functions return.  Under nbval or any headless
run nothing is typed: `reveal` then says so and still shows the measured answer.
"""

from __future__ import annotations

import html
import math
import numbers
from dataclasses import dataclass, field


def relative_error(guess: float, actual: float) -> float:
    """|guess - actual| / |actual|; 0 when both are 0, infinity when only the answer is 0."""
    guess, actual = _number(guess, "guess"), _number(actual, "actual")
    if actual == 0:
        return 0.0 if guess == 0 else math.inf
    return abs(guess - actual) / abs(actual)


def judge_number(guess: float | None, actual: float, unit: str = "", tolerance: float = 0.1,
                 label: str = "measured") -> str:
    """One sentence: the guess beside the answer (`label` says where it came from: "measured", "counted",
    "simulated", ...), its relative error, within `tolerance` or not."""
    actual = _number(actual, "actual")
    _check_tolerance(tolerance)
    measured = f"{label}: {_show(actual, unit)}"
    if guess is None:
        return f"No guess was entered (a headless run, or the box was left empty); {measured}."
    error = relative_error(guess, actual)
    direction = "" if guess == actual else (" (too high)" if guess > actual else " (too low)")
    verdict = "within" if error <= tolerance else "outside"
    off = "exact" if error == 0 else f"off by {error:.0%}{direction}" if math.isfinite(error) else "off (the answer is 0)"
    return f"Your guess: {_show(guess, unit)}; {measured}: {off}, {verdict} {tolerance:.0%}."


def judge_choice(guess: int | None, actual: int | str, choices: list[str]) -> str:
    """One sentence: the option picked beside the right one (`actual` an index into `choices` or one of them)."""
    right = choice_index(actual, choices)
    answer = f"the answer: “{choices[right]}”"
    if guess is None:
        return f"No option was picked (a headless run, or the box was left empty); {answer}."
    picked = choice_index(guess, choices)
    verdict = "right" if picked == right else "not this time"
    return f"You picked “{choices[picked]}”; {answer}: {verdict}."


def choice_index(value: int | str, choices: list[str]) -> int:
    """The index of `value` in `choices` (given as an index or as the option's text)."""
    if isinstance(value, str):
        if value not in choices:
            raise ValueError(f"{value!r} is not one of the choices {choices}")
        return choices.index(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"a choice is an index into the choices or one of them, not {value!r}")
    if not 0 <= value < len(choices):
        raise ValueError(f"choice index {value} is out of range for {len(choices)} choices")
    return int(value)


def parse_number(text: str, unit: str = "") -> float | None:
    """What the learner typed as a number: '36', '1e3', '1,000', '25 %', '3/11'; None if empty.

    The question's unit may follow the number ('36 s' when unit is 's').  Raises ValueError
    on anything else, with the text in the message.
    """
    cleaned = text.strip().replace(",", "").replace("\u00d7", "")
    for suffix in sorted({unit.strip(), "%", "x"} - {""}, key=len, reverse=True):
        if cleaned.endswith(suffix):
            cleaned = cleaned[: -len(suffix)].strip()
            break
    if not cleaned:
        return None
    try:
        if "/" in cleaned:
            numerator, denominator = cleaned.split("/")
            return float(numerator) / float(denominator)
        return float(cleaned)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"not a number: {text!r} (type e.g. 36, 0.25, 3/11)") from None


@dataclass
class Revealed:
    """What `Prediction.reveal` shows: the verdict sentence and the explanation (displays as HTML)."""

    text: str
    explanation: str = ""

    def __str__(self) -> str:
        return f"{self.text} {self.explanation}".strip()

    def _repr_html_(self) -> str:
        why = f"<br>{html.escape(self.explanation)}" if self.explanation else ""
        return f"<div><b>{html.escape(self.text)}</b>{why}</div>"

    def _repr_pretty_(self, printer, cycle):
        printer.text(str(self))


@dataclass
class Prediction:
    """A question asked before a run.  Display it (it is the last value of a cell) to show the input box."""

    question: str
    choices: list[str] | None = None
    unit: str = ""
    tolerance: float = 0.1
    _widget: object = field(default=None, init=False, repr=False)
    _typed: object = field(default=None, init=False, repr=False)
    _feedback: object = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if not isinstance(self.question, str) or not self.question.strip():
            raise ValueError("a prediction needs a question (a non-empty string)")
        if self.choices is not None:
            _check_choices(self.choices)
        _check_tolerance(self.tolerance)

    @property
    def widget(self):
        """The ipywidgets box: the question, a text box (or radio buttons for choices), a feedback line."""
        if self._widget is None:
            import ipywidgets as w

            if self.choices is None:
                self._typed = w.Text(placeholder=f"your guess{' in ' + self.unit if self.unit else ''}",
                                     continuous_update=False)
            else:
                self._typed = w.RadioButtons(options=list(self.choices), value=None, layout=w.Layout(width="auto"))
            self._feedback = w.HTML()
            self._typed.observe(self._on_entry, names="value")
            self._widget = w.VBox([w.HTML(f"<b>Predict:</b> {html.escape(self.question)}"), self._typed,
                                   self._feedback])
        return self._widget

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    @property
    def guess(self) -> float | int | None:
        """The number typed (or the index of the option picked); None until something is entered."""
        if self._typed is None:
            return None
        if self.choices is not None:
            return self._typed.index
        try:
            return parse_number(self._typed.value, self.unit)
        except ValueError:
            return None

    def enter(self, value: float | int | str) -> None:
        """Enter a guess from the kernel, as the learner would in the box (a number, or an option / its index)."""
        self.widget  # noqa: B018 - builds the input
        if self.choices is not None:
            self._typed.index = choice_index(value, self.choices)
        else:
            self._typed.value = value if isinstance(value, str) else repr(_number(value, "guess"))

    def verdict(self, actual: float | int | str, label: str = "measured") -> str:
        """The guess judged against `actual`: relative error for a number, right/wrong for a choice.

        `label` names where a number came from ("measured", "counted", "simulated", "formula").
        """
        if self.choices is not None:
            return judge_choice(self.guess, actual, self.choices)
        return judge_number(self.guess, actual, self.unit, self.tolerance, label)

    def reveal(self, actual: float | int | str, explanation: str = "", label: str = "measured") -> Revealed:
        """Show the answer beside the guess; an entered guess is then locked (the box is disabled).

        `label` names where a number came from: "measured" (the default), or "counted", "simulated", ...
        """
        shown = Revealed(self.verdict(actual, label), explanation)
        if self._widget is not None:
            self._feedback.value = shown._repr_html_()
            if self.guess is not None:
                self._typed.disabled = True
        return shown

    def _on_entry(self, change):
        if self.choices is not None:
            return
        try:
            parse_number(change["new"], self.unit)
            self._feedback.value = ""
        except ValueError as error:
            self._feedback.value = f"<i>{html.escape(str(error))}</i>"


def predict(question: str, *, choices: list[str] | None = None, unit: str = "", tolerance: float = 0.1) -> Prediction:
    """Ask for a guess before a run: a number (relative error judged against `tolerance`) or one of `choices`."""
    return Prediction(question, list(choices) if choices is not None else None, unit, tolerance)


@dataclass(frozen=True)
class Question:
    """One multiple-choice question: `answer` is the right option (its index, or its text, kept as the index),
    `why` says why it is right."""

    text: str
    choices: list[str]
    answer: int
    why: str = ""

    def __post_init__(self):
        if not isinstance(self.text, str) or not self.text.strip():
            raise ValueError("a question needs its text (a non-empty string)")
        _check_choices(self.choices)
        object.__setattr__(self, "answer", choice_index(self.answer, self.choices))  # frozen: set once here


@dataclass
class Quiz:
    """A lesson-end quiz.  Display it to pick answers and press "check"; `check` judges a list in the kernel."""

    questions: list[Question]
    _widget: object = field(default=None, init=False, repr=False)
    _pickers: list = field(default_factory=list, init=False, repr=False)
    _feedback: object = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if not self.questions or not all(isinstance(q, Question) for q in self.questions):
            raise TypeError("a quiz is a non-empty list of pl.quiz.Question")

    def check(self, answers: list[int]) -> list[bool]:
        """For each question, whether the given option index is the right one."""
        answers = list(answers)
        if len(answers) != len(self.questions):
            raise ValueError(f"{len(answers)} answers for {len(self.questions)} questions")
        return [choice_index(a, q.choices) == q.answer for a, q in zip(answers, self.questions)]

    def feedback(self, answers: list[int | None]) -> list[str]:
        """One line per question: right / not right / unanswered, then why the right option is right."""
        lines = []
        for number, (picked, q) in enumerate(zip(answers, self.questions), 1):
            if picked is None:
                head = "not answered"
            else:
                head = "right" if choice_index(picked, q.choices) == q.answer else "not right"
            lines.append(f"{number}. {head}: the answer is “{q.choices[q.answer]}”. {q.why}".strip())
        return lines

    @property
    def selected(self) -> list[int | None]:
        """The option index picked in each question's buttons (None where nothing is picked yet)."""
        return [p.index for p in self._pickers] if self._pickers else [None] * len(self.questions)

    @property
    def widget(self):
        if self._widget is None:
            import ipywidgets as w

            rows = []
            for number, q in enumerate(self.questions, 1):
                picker = w.RadioButtons(options=list(q.choices), value=None, layout=w.Layout(width="auto"))
                self._pickers.append(picker)
                rows += [w.HTML(f"<b>{number}. {html.escape(q.text)}</b>"), picker]
            button = w.Button(description="check", icon="check")
            self._feedback = w.HTML()
            button.on_click(lambda _: self.show_feedback())
            self._widget = w.VBox(rows + [button, self._feedback])
            self._widget.button = button
        return self._widget

    def show_feedback(self) -> list[str]:
        """What "check" does: judge the picked options and show one line per question."""
        lines = self.feedback(self.selected)
        if self._feedback is not None:
            self._feedback.value = "<br>".join(html.escape(line) for line in lines)
        return lines

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


def quiz(questions: list[Question]) -> Quiz:
    """A lesson-end quiz from `Question`s."""
    return Quiz(list(questions))


def _number(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise TypeError(f"{name} must be a number, not {value!r}")
    return float(value)


def _check_tolerance(tolerance) -> None:
    if not isinstance(tolerance, numbers.Real) or isinstance(tolerance, bool) or not tolerance >= 0:
        raise ValueError(f"tolerance is a relative error >= 0 (0.1 = 10 %), not {tolerance!r}")


def _check_choices(choices) -> None:
    if (not isinstance(choices, (list, tuple)) or len(choices) < 2
            or not all(isinstance(c, str) and c for c in choices)):
        raise ValueError(f"choices must be a list of at least two non-empty strings, not {choices!r}")
    if len(set(choices)) != len(choices):
        raise ValueError(f"choices must differ from one another: {choices!r}")


def _show(value: float, unit: str) -> str:
    number = f"{value:.4g}"
    if not unit:
        return number
    return f"{number}{unit}" if unit in ("%", "x", "\u00d7") else f"{number} {unit}"
