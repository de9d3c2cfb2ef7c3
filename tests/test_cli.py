"""The command line: every subcommand answers --help."""

import re
import subprocess
import sys

import pytest
from conftest import REPO

from environments.framework.registry import ENVIRONMENTS
from lachesis.cli import ENV_ACTIONS, main


def help_of(argv: list[str], capsys) -> str:
    """What ``lachesis ARGV`` prints, asserting it ends with status 0 and no error."""
    try:
        status = main(argv)
    except SystemExit as exit:  # argparse's --help
        status = exit.code
    out, err = capsys.readouterr()
    assert (status, err) == (0, ""), f"lachesis {' '.join(argv)}: {status} {err}"
    assert out.startswith("usage: lachesis"), out
    return out


def test_every_subcommand_prints_its_help(capsys):
    top = help_of(["--help"], capsys)
    commands = re.search(r"\{([a-z,-]+)\}", top).group(1).split(",")
    assert {"api", "env", "train", "run", "inspect", "report", "make-tiny-model"} <= set(commands)
    for command in commands:
        assert command in help_of([command, "--help"], capsys)
    env = help_of(["env", "--help"], capsys)
    for action in ENV_ACTIONS:
        assert action in env
        for flag in ("--help", "-h"):  # without NAME: the action's own flags and what NAME is
            text = help_of(["env", action, flag], capsys)
            assert f"usage: lachesis env {action} NAME" in text and "--config" in text
            assert all(name in text for name in ENVIRONMENTS)
            assert ("--out" in text) == (action == "process")
        # with NAME: also every setting of the env's config class
        text = help_of(["env", action, "arithmetic_tool", "--help"], capsys)
        assert "--group-size" in text and "--keep-equal-score-groups" in text


def test_env_action_without_name_or_help_says_what_is_missing(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["env", "process"])
    assert exit.value.code == 2
    assert "the following arguments are required: name" in capsys.readouterr().err


def test_env_process_help_through_the_real_command():
    done = subprocess.run([sys.executable, "-m", "lachesis.cli", "env", "process", "--help"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "usage: lachesis env process NAME" in done.stdout and "--groups" in done.stdout


def test_env_settings_help_shows_each_settings_whole_first_sentence(capsys):
    """A setting's help is its docstring's first sentence, however it wraps in the
    source, up to the default (not cut at the docstring's first line)."""
    from environments.envs.arithmetic_tool import ArithmeticToolConfig
    from lachesis.cli import first_sentence

    for action in ("process", "serve"):
        text = " ".join(help_of(["env", action, "arithmetic_tool", "--help"], capsys).split())
        for name, field in ArithmeticToolConfig.model_fields.items():
            if field.description:
                sentence = " ".join(first_sentence(field.description).split())
                assert f"{sentence} (default: " in text, name
        assert ("Stop with an error when this many groups in a row fail (a broken setup, e.g. "
                "a prompt longer than max_token_length, would otherwise retry forever). "
                "(default: 20)") in text
    assert first_sentence("Extra sampling (e.g. ``top_k``). ``None``: off.") == \
        "Extra sampling (e.g. ``top_k``)."
