"""docs/configuration.md is generated from sketchkv/config.py: the committed page must equal the generator's output;
every knob has a help line; every command's --help renders and shows an example."""
import pathlib

from sketchkv import config as C
from sketchkv.config_docs import markdown

PAGE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_configuration_reference_is_up_to_date():
    assert PAGE.read_text() == markdown(), "run: python -m sketchkv.config_docs > docs/configuration.md"


def test_every_knob_has_a_help_line_in_the_reference():
    text = markdown()
    for name, _, f in C.flat_fields():
        assert f.metadata.get("help"), f"{name}: add metadata={{'help': ...}} in sketchkv/config.py"
        assert f"SKETCHKV_{name.upper()}" in text


def test_every_command_help_renders():
    """--help of every subcommand works (a stray % in a help text breaks argparse's formatting) and ends with an
    example."""
    import argparse

    from sketchkv.cli import build_parser

    def walk(parser, path):
        yield path, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, path + [name])

    for path, parser in walk(build_parser(), []):
        assert "example" in parser.format_help(), f"sketchkv {' '.join(path)} --help shows no example"
