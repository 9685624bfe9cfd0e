"""Hand-written cases for the math answer verifier (rlrecipes.rewards.math_verify)."""
import pytest

from rlrecipes.rewards import extract_answer, last_boxed, math_verify

CORRECT = [
    # (completion, reference)
    ("The answer is \\boxed{42}.", "42"),
    ("\\boxed{42}", "42.0"),
    ("so \\boxed{-7}", "-7"),
    ("\\boxed{+7}", "7"),
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}"),
    ("\\boxed{\\tfrac{3}{4}}", "0.75"),
    ("\\boxed{3/4}", "\\frac34"),
    ("\\boxed{-\\frac{2}{3}}", "-2/3"),
    ("\\boxed{0.6667}", "\\frac{2}{3}"),
    ("\\boxed{1,234}", "1234"),
    ("\\boxed{1,234,567.5}", "1234567.5"),
    ("\\boxed{\\$1,000}", "1000"),
    ("\\boxed{\\$5.50}", "5.5"),
    ("\\boxed{5 \\text{ dollars}}", "5"),
    ("\\boxed{12 \\text{ cm}}", "12"),
    ("\\boxed{12\\,\\mathrm{cm}^2}", "12"),
    ("\\boxed{90^\\circ}", "90"),
    ("\\boxed{90^{\\circ}}", "90"),
    ("\\boxed{50\\%}", "50"),
    ("\\boxed{50\\%}", "0.5"),
    ("\\boxed{25%}", "25\\%"),
    ("\\boxed{x = 5}", "5"),
    ("\\boxed{k=3}", "3"),
    ("$\\boxed{10}$", "10"),
    ("first \\boxed{3} then corrected \\boxed{4}", "4"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),
    ("\\boxed{\\dfrac{\\pi}{2}}", "\\frac{\\pi}{2}"),
    ("\\boxed{\\sqrt{2}}", "\\sqrt2"),
    ("\\boxed{x^{2}+1}", "x^2+1"),
    ("\\boxed{(1, 2)}", "(1,2)"),
    ("\\boxed{(1.0, -2)}", "(1,-2)"),
    ("\\boxed{[0, 1)}", "[0,1)"),
    ("\\boxed{\\left( 3, 4 \\right)}", "(3,4)"),
    ("\\boxed{(B)}", "B"),
    ("\\boxed{\\text{(C)}}", "C"),
    ("\\boxed{\\text{yes}}", "Yes"),
    ("\\boxed{2\\frac{1}{2}}", "2.5"),
    ("\\boxed{1.5 \\times 10^{3}}", "1500"),
    ("\\boxed{1e3}", "1000"),
    ("\\boxed{0.1}", ".1"),
    ("\\boxed{3.14159}", "3.14159265"),
    ("The total is 72 apples.", "72"),
    ("It costs $1,250 in total.", "1250"),
    ("so 3/4 of them", "0.75"),
    ("We get x = -3.", "-3"),
    ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),
    ("\\boxed{72}", "#### 72"),
    ("\\boxed{72}", "The answer is \\boxed{72}"),
    ("\\boxed{\\boxed{8}}", "8"),
    ("\\boxed{{8}}", "8"),
    ("\\boxed 9", "9"),
    ("\\fbox{11}", "11"),
    ("\\boxed{\\text{USD } 20}", "20"),
    ("\\boxed{€15}", "15"),
    ("\\boxed{7 \\text{ hours}}", "7"),
    ("\\boxed{100.}", "100"),
    ("\\boxed{\\left(\\frac{1}{2}, \\frac{1}{3}\\right)}", "(0.5,0.3333333)"),
    ("\\boxed{-0}", "0"),
    ("\\boxed{2,3}", "2, 3"),
]

WRONG = [
    ("\\boxed{41}", "42"),
    ("\\boxed{-42}", "42"),
    ("\\boxed{\\frac{1}{3}}", "0.34"),
    ("\\boxed{0.66}", "\\frac{2}{3}"),
    ("\\boxed{1,234}", "1243"),
    ("\\boxed{x^3+1}", "x^2+1"),
    ("\\boxed{(1, 3)}", "(1,2)"),
    ("\\boxed{[0, 1]}", "[0,1)"),
    ("\\boxed{(2, 1)}", "(1,2)"),
    ("\\boxed{B}", "C"),
    ("\\boxed{no}", "yes"),
    ("no answer at all", "5"),
    ("", "5"),
    ("\\boxed{}", "5"),
    ("\\boxed{5", "5"),  # unbalanced box -> nothing extracted
    ("\\boxed{4} and then 5", "5"),  # the box wins over a later number
    ("The answer is 7, not 8.", "7"),  # last number is 8
    ("\\boxed{12}", "1.2"),
    ("\\boxed{\\sqrt{3}}", "\\sqrt{2}"),
    ("\\boxed{1/0}", "1/0x"),
]


@pytest.mark.parametrize("completion,answer", CORRECT)
def test_correct(completion, answer):
    assert math_verify(completion, answer) == 1.0


@pytest.mark.parametrize("completion,answer", WRONG)
def test_wrong(completion, answer):
    assert math_verify(completion, answer) == 0.0


def test_case_count():
    assert len(CORRECT) + len(WRONG) >= 60


def test_last_boxed_nested():
    assert last_boxed("a \\boxed{1} b \\boxed{\\frac{a}{b^{2}}} c") == "\\frac{a}{b^{2}}"
    assert last_boxed("no box") is None
    assert last_boxed("\\boxed{unbalanced") is None


def test_extract_fallbacks():
    assert extract_answer("x is 3 and y is -1,500.25 today") == "-1,500.25"
    assert extract_answer("growth of 12% per year") == "12%"
    assert extract_answer("nothing numeric") is None
    assert extract_answer("foo #### 18") == "18"


def test_non_string_inputs_do_not_crash():
    assert math_verify(None, "1") == 0.0
    assert math_verify("\\boxed{3}", 3) == 1.0
