"""pl.quiz: the judging on its own (no frontend), then the widgets driven from the kernel."""

import math

import pytest

import pipelab as pl
from pipelab.course.quiz import choice_index, judge_choice, judge_number, parse_number, relative_error


def test_relative_error_against_the_answer():
    assert relative_error(30, 40) == pytest.approx(0.25)
    assert relative_error(50, 40) == pytest.approx(0.25)
    assert relative_error(-4, -5) == pytest.approx(0.2)
    assert relative_error(0, 0) == 0.0 and relative_error(1, 0) == math.inf
    with pytest.raises(TypeError, match="guess must be a number"):
        relative_error("3", 4)
    with pytest.raises(TypeError, match="actual must be a number"):
        relative_error(3, float("nan"))


def test_judge_number_states_guess_answer_error_and_tolerance():
    text = judge_number(30, 40, unit="s", tolerance=0.1)
    assert "30 s" in text and "40 s" in text and "25%" in text and "too low" in text and "outside 10%" in text
    assert "within 10%" in judge_number(41, 40) and "too high" in judge_number(41, 40)
    assert "exact" in judge_number(0.25, 0.25)
    assert "within 30%" in judge_number(30, 40, tolerance=0.3)  # 25 % <= 30 %: the boundary is inclusive
    assert "within" in judge_number(0.9, 1.0, tolerance=0.1)


def test_the_answer_says_where_it_came_from():
    assert "counted: 27.3%" in judge_number(25, 27.3, "%", label="counted")
    guess = pl.quiz.predict("?", unit="%")
    assert "simulated: 36" in guess.reveal(36, label="simulated").text
    assert "measured: 36" in guess.verdict(36)


def test_no_guess_still_shows_the_answer():
    text = judge_number(None, 36.0, unit="s")
    assert text.startswith("No guess was entered") and "36 s" in text
    choice = judge_choice(None, 1, ["GPipe", "1F1B"])
    assert choice.startswith("No option was picked") and "1F1B" in choice


def test_judge_choice_by_index_or_text():
    assert judge_choice(1, "1F1B", ["GPipe", "1F1B"]).endswith("right.")
    assert judge_choice(0, 1, ["GPipe", "1F1B"]).endswith("not this time.")
    with pytest.raises(ValueError, match="not one of the choices"):
        judge_choice(0, "DualPipe", ["GPipe", "1F1B"])
    with pytest.raises(ValueError, match="out of range"):
        choice_index(2, ["a", "b"])
    with pytest.raises(TypeError, match="index into the choices"):
        choice_index(True, ["a", "b"])


@pytest.mark.parametrize("typed, unit, number", [
    ("36", "", 36.0), (" 1e3 ", "", 1000.0), ("1,000", "", 1000.0), ("25 %", "%", 25.0),
    ("25%", "", 25.0), ("3/11", "", 3 / 11), ("36 s", "s", 36.0), ("2.5x", "x", 2.5), ("", "", None),
    ("  ", "s", None),
])
def test_parse_number(typed, unit, number):
    assert parse_number(typed, unit) == (pytest.approx(number) if number is not None else None)


@pytest.mark.parametrize("typed", ["about 30", "3/0", "1/2/3", "s"])
def test_parse_number_rejects_what_is_not_a_number(typed):
    with pytest.raises(ValueError, match="not a number"):
        parse_number(typed, "")


def test_prediction_guess_is_none_until_entered_then_judged():
    guess = pl.quiz.predict("Makespan of GPipe for p=4, m=8?", unit="t_F")
    assert guess.guess is None
    assert guess.verdict(36.0).startswith("No guess")
    guess.widget.children[1].value = "30"  # what the learner types
    assert guess.guess == 30.0
    assert "off by 17%" in guess.verdict(36.0)
    guess.widget.children[1].value = "thirty"
    assert guess.guess is None and "not a number" in guess.widget.children[2].value


def test_reveal_shows_the_answer_and_locks_an_entered_guess():
    empty = pl.quiz.predict("Bubble share?", unit="%")
    shown = empty.reveal(27.3, explanation="(p-1)/(m+p-1) = 3/11")
    assert "No guess" in shown.text and "27.3%" in shown.text and "3/11" in str(shown)
    assert "3/11" in shown._repr_html_()
    empty.widget  # displayed after the reveal: still open for a guess
    assert not empty.widget.children[1].disabled

    entered = pl.quiz.predict("Bubble share?", unit="%")
    entered.enter(25)
    shown = entered.reveal(27.3)
    assert "25%" in shown.text and "within 10%" in shown.text
    assert entered.widget.children[1].disabled and "27.3%" in entered.widget.children[2].value


def test_prediction_and_quiz_display_as_widgets():
    assert "application/vnd.jupyter.widget-view+json" in pl.quiz.predict("?")._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in _two_questions()._repr_mimebundle_()


def test_prediction_with_choices():
    guess = pl.quiz.predict("Which schedule keeps fewer activations?", choices=["GPipe", "1F1B", "the same"])
    assert guess.guess is None
    guess.enter("1F1B")
    assert guess.guess == 1
    assert guess.verdict("1F1B").endswith("right.") and guess.verdict(2).endswith("not this time.")
    assert "“1F1B”" in guess.reveal(1).text


def test_prediction_rejects_bad_input():
    with pytest.raises(ValueError, match="needs a question"):
        pl.quiz.predict("")
    with pytest.raises(ValueError, match="at least two"):
        pl.quiz.predict("?", choices=["only one"])
    with pytest.raises(ValueError, match="differ"):
        pl.quiz.predict("?", choices=["a", "a"])
    with pytest.raises(ValueError, match="tolerance"):
        pl.quiz.predict("?", tolerance=-0.1)
    with pytest.raises(TypeError, match="actual must be a number"):
        pl.quiz.predict("?").verdict("36")


def _two_questions():
    return pl.quiz.quiz([
        pl.quiz.Question("GPipe's bubble for p=4, m=8?", ["3/8", "3/11", "4/11"], answer=1, why="(p-1)/(m+p-1)"),
        pl.quiz.Question("Which stage holds the most under 1F1B?", ["the first", "the last"], answer=0,
                         why="stage s keeps min(p-s, m)"),
    ])


def test_quiz_checks_answers_in_the_kernel():
    check = _two_questions()
    assert check.check([1, 0]) == [True, True]
    assert check.check([0, 0]) == [False, True]
    assert check.check(["3/11", "the last"]) == [True, False]
    with pytest.raises(ValueError, match="2 answers for 2|1 answers for 2 questions"):
        check.check([1])
    with pytest.raises(ValueError, match="out of range"):
        check.check([1, 5])


def test_question_answer_given_as_text_is_its_index():
    check = pl.quiz.quiz([pl.quiz.Question("?", ["a", "b"], answer="b", why="b")])
    assert check.questions[0].answer == 1
    assert check.check([1]) == [True] and check.check(["a"]) == [False]
    assert check.feedback([1]) == ["1. right: the answer is “b”. b"]


def test_quiz_widget_check_button():
    check = _two_questions()
    box = check.widget
    assert check.selected == [None, None]
    check._pickers[0].index = 1
    box.button.click()
    lines = check._feedback.value.split("<br>")
    assert lines[0].startswith("1. right") and lines[1].startswith("2. not answered")
    check._pickers[1].index = 1
    assert check.show_feedback()[1].startswith("2. not right") and "min(p-s, m)" in check.show_feedback()[1]


def test_question_is_validated():
    with pytest.raises(ValueError, match="out of range"):
        pl.quiz.Question("?", ["a", "b"], answer=2)
    with pytest.raises(ValueError, match="needs its text"):
        pl.quiz.Question(" ", ["a", "b"], answer=0)
    with pytest.raises(TypeError, match="list of pl.quiz.Question"):
        pl.quiz.quiz([])
