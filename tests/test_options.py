"""The generation options are defined once (options.CATALOGUE: type, default, range, help);
the Python API's defaults and checks, the command line's flags, chat's /set and the server's
fields are made from it."""
import argparse
import dataclasses
import io
import re

import pytest

from edgespec import chat, cli
from edgespec.apps.server import openai_api
from edgespec.errors import SettingError
from edgespec.options import CATALOGUE, DEFAULT, DRAFT, MAX_STOP_CHARS, MAX_STOPS, SAMPLING
from edgespec.sampling import SamplingParams
from edgespec.settings import DraftPolicy, Settings


def flags(command: str) -> dict:
    """The options of an `edgespec COMMAND` parser, by flag."""
    sub = next(a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {flag: action for action in sub.choices[command]._actions
            for flag in action.option_strings}


def test_the_catalogue_names_every_field_of_the_settings_it_feeds():
    fields = {f.name for f in dataclasses.fields(SamplingParams)} | \
        {f.name for f in dataclasses.fields(DraftPolicy)} | \
        {f.name for f in dataclasses.fields(Settings)} - {"sampling", "draft"}
    assert set(CATALOGUE) == fields


def test_every_field_defaults_to_its_catalogue_value():
    settings = Settings()
    for objekt in (settings.sampling, settings.draft, settings):
        for field in dataclasses.fields(objekt):
            if field.name in CATALOGUE:
                assert getattr(objekt, field.name) == DEFAULT[field.name], field.name


@pytest.mark.parametrize("command", ["generate", "chat", "bench", "desktop"])
def test_every_sampling_and_draft_option_is_a_flag_with_its_help_range_and_default(command):
    made = flags(command)
    for option in (*SAMPLING, *DRAFT):
        help = made[option.flag].help
        assert help.startswith(option.help) and option.default_text in help
        assert option.kind is bool or option.expected in help
        assert made[option.flag].default is None  # not given: the model's


@pytest.mark.parametrize("command, default", [("generate", None), ("chat", 512),
                                              ("bench", 128), ("desktop", None)])
def test_max_new_tokens_is_the_catalogues_with_a_commands_own_default(command, default):
    flag = flags(command)["--max-new-tokens"]
    assert flag.default == default  # None: the catalogue's
    assert f"(default: {default or DEFAULT['max_new_tokens']})" in flag.help
    assert CATALOGUE["max_new_tokens"].expected in flag.help


@pytest.mark.parametrize("command", ["generate", "chat", "desktop"])
def test_mode_is_a_flag_and_plain_is_not(command):
    assert "--plain" not in flags(command)
    args = cli.parser().parse_args([command, "art", "--mode", "plain"] +
                                   (["-p", "hi"] if command == "generate" else []))
    assert Settings().with_options(**cli._options(args)).mode == "plain"


def test_a_bad_value_is_refused_with_its_name_value_and_range():
    with pytest.raises(SettingError, match=r"^invalid top-p 1.5: it must be in \(0, 1\]$"):
        Settings().with_options(top_p=1.5)
    with pytest.raises(SettingError, match=r"^invalid mode 'turbo': it must be one of "
                       "speculative, plain$"):
        Settings(mode="turbo")
    with pytest.raises(SettingError, match=r"^invalid draft-k 33: it must be an integer in "
                       r"\[0, 32\]$"):
        DraftPolicy(draft_k=33)
    with pytest.raises(SettingError, match=r"^invalid seed -1: it must be an integer in "
                       r"\[0, 2\*\*63\)$"):
        SamplingParams(seed=-1)


def test_chat_sets_every_option_but_the_per_reply_ones():
    assert set(chat.SETTINGS) == set(CATALOGUE) - {"stop", "ignore_eos"}
    for name in chat.SETTINGS:
        assert name in chat.HELP


def test_a_flag_of_the_catalogue_reaches_the_settings():
    args = cli.parser().parse_args(["generate", "art", "-p", "hi", "--top-k", "7",
                                    "--no-adaptive", "--draft-threshold", "0.5"])
    settings = Settings().with_options(**cli._options(args))
    assert (settings.sampling.top_k, settings.draft.adaptive,
            settings.draft.draft_threshold) == (7, False, 0.5)


# -- one range, enforced alike everywhere ------------------------------------------------------

CANNOT = object()  # a value an entry point has no way to say (a flag that takes no value)


def probes(option) -> list:
    """Values at, just inside and just beyond each end of an option's range, and of other
    types."""
    if option.kind is bool:
        return [True, False, 1, 0, "yes"]
    if option.choices:
        return [*option.choices, option.choices[0].upper(), "", 5]
    if option.kind is str:  # stop: a string or a list of them
        return ["end", ["a", "b"], "", "x" * (MAX_STOP_CHARS + 1), ["a"] * (MAX_STOPS + 1), 5]
    step = 1 if option.kind is int else 1e-6
    values = [end + d for end in (option.low, option.high) if end is not None
              for d in (-step, 0, step)]
    if option.high is None:
        values.append(option.low + 1)  # (the server's own cap on temperature is 2)
    return values + ([1.5] if option.kind is int else [float("nan"), float("inf")]) + \
        ["x", True, None]


def by_the_api(option, value):
    """The error the Python API gives the value (None: taken)."""
    try:
        Settings().with_options(**{option.name: value})
    except SettingError as e:
        return str(e)


def by_the_command_line(option, value):
    if isinstance(value, bool) != (option.kind is bool):
        return CANNOT  # text says true and false only as a flag's presence
    if option.kind is bool:
        given = [option.flag if value else "--no-" + option.flag[2:]]
    elif value is None:
        given = []  # not given
    elif option.name == "stop":
        if not isinstance(value, (str, list)):
            return CANNOT
        given = [f"--stop={text}" for text in ([value] if isinstance(value, str) else value)]
    else:
        given = [f"{option.flag}={value}"]
    try:
        cli._options(cli.parser().parse_args(["generate", "art", "-p", "hi", *given]))
    except SettingError as e:
        return str(e)


class Defaults:
    """What chat and the server need of a model here: its settings, the catalogue's
    defaults (as a model whose artifact sets none)."""

    def settings(self, **options):
        return Settings().with_options(**options)


def by_chat(option, value):
    if option.name not in chat.SETTINGS or value is None or \
            isinstance(value, bool) != (option.kind is bool):
        return CANNOT
    if option.kind is bool:
        value = int(value)  # chat's flags are 0 and 1
    session = chat.ChatSession(Defaults(), {}, out=io.StringIO())
    session._set(option.name, str(value))
    said = session.out.getvalue().strip()
    return said[len("[not set: "):-1] if said.startswith("[not set: ") else None


def by_the_server(option, value):
    """The server's error, in the API's spelling of the option (the server names its own
    field: top_p, max_tokens)."""
    field = {"max_new_tokens": "max_tokens"}.get(option.name, option.name)
    if field not in (*openai_api.FIELDS, "max_tokens", "stop"):
        return CANNOT  # the draft policy is the artifact's
    try:
        openai_api.generation_settings({field: value}, Defaults(), allow_ignore_eos=True)
    except openai_api.BadRequest as e:
        assert e.param == field
        return str(e).replace(f"invalid {field} ", f"invalid {option.flag[2:]} ", 1)


def verdict(error):
    """An error without the value it shows (text shows 1.5 as '1.5'): the option and range."""
    return error if error in (None, CANNOT) else \
        re.sub(r"^(invalid \S+) .*?: it must be ", r"\1: it must be ", error)


@pytest.mark.parametrize("name", CATALOGUE)
def test_an_options_range_is_enforced_alike_by_the_api_command_line_chat_and_server(name):
    option = CATALOGUE[name]
    for value in probes(option):
        expected = verdict(by_the_api(option, value))
        for entry in (by_the_command_line, by_chat, by_the_server):
            got = verdict(entry(option, value))
            assert got is CANNOT or got == expected, (entry.__name__, value, got, expected)
