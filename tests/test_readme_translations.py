"""The README translations (README.zh-CN.md, README.ja.md, README.de.md, README.ru.md)
stay in step with the English README and the code: the same commands, the same code
example, the same defaults table, option names that exist, links that resolve."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import ruda_torch

ROOT = Path(__file__).resolve().parents[1]
ENGLISH = (ROOT / "README.md").read_text()
TRANSLATIONS = ["README.zh-CN.md", "README.ja.md", "README.de.md", "README.ru.md"]


def _python_block(text: str) -> str:
    return re.search(r"```python\n(.*?)```", text, re.S).group(1)


def _defaults_table(text: str) -> str:
    return re.search(r"(\| option +\|.*?)\n\n", text, re.S).group(1)


def _commands(text: str) -> list[str]:
    return re.findall(r"^    (make \w[\w-]*)$", text, re.M)


@pytest.mark.parametrize("name", TRANSLATIONS)
def test_translation_matches_the_english_readme(name):
    text = (ROOT / name).read_text()
    assert _python_block(text) == _python_block(ENGLISH), "the usage example differs"
    assert _defaults_table(text) == _defaults_table(ENGLISH), "the defaults table differs"
    assert _commands(text) == _commands(ENGLISH)[: len(_commands(text))] and _commands(text)
    for other in ["README.md", *TRANSLATIONS]:
        assert f"]({other})" in text, f"no link to {other}"
        assert f"]({name})" in (ROOT / other).read_text(), f"{other} does not link {name}"


@pytest.mark.parametrize("name", ["README.md", *TRANSLATIONS])
def test_option_names_and_links_exist(name):
    text = (ROOT / name).read_text()
    params = set(inspect.signature(ruda_torch.AdamW).parameters)
    params |= set(inspect.signature(ruda_torch.Adam).parameters)  # ruda_torch.Adam's own
    for option in re.findall(r"`([a-z_]+)=", text):  # keyword arguments, not env switches
        assert option in params, f"{name}: `{option}=` is not an argument of ruda_torch.AdamW"
    for link in re.findall(r"\]\(([^)#]+)", text):
        if not link.startswith("http"):
            assert (ROOT / link).exists(), f"{name}: broken link {link}"
