"""The generation options are defined once (settings.CATALOGUE); the command line, chat's
/set and the server's fields are made from it."""
import argparse
import dataclasses

import pytest

from edgespec import chat, cli
from edgespec.sampling import SamplingParams
from edgespec.settings import CATALOGUE, DRAFT, SAMPLING, DraftPolicy, Settings


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


@pytest.mark.parametrize("command", ["generate", "chat", "bench"])
def test_every_sampling_and_draft_option_is_a_flag_with_its_help(command):
    made = flags(command)
    for option in (*SAMPLING, *DRAFT):
        assert made[option.flag].help == option.help
        assert made[option.flag].default is None  # not given: the model's


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
