"""Orca's settings follow the checkpoint's context: defaults shrink to it, a setting given past it is refused."""

from __future__ import annotations

import pytest

from handlers.orca.config import OrcaConfig, OrcaConfigError


def test_defaults_shrink_to_a_short_checkpoint_context_and_stay_valid():
    fitted = OrcaConfig().fitted_to(128, given={})
    assert fitted.max_tokens == 128 and fitted.max_new_tokens == 64 and fitted.default_new_tokens == 16
    tiny = OrcaConfig().fitted_to(20, given={})
    assert (tiny.max_tokens, tiny.max_new_tokens, tiny.default_new_tokens) == (20, 10, 10)


def test_a_long_context_keeps_the_defaults():
    assert OrcaConfig().fitted_to(1024, given={}) == OrcaConfig()


def test_settings_given_are_kept_when_they_fit_and_refused_by_name_when_they_do_not():
    given = {"max_tokens": 48, "max_new_tokens": 40}
    fitted = OrcaConfig.from_dict(given).fitted_to(64, given)
    assert (fitted.max_tokens, fitted.max_new_tokens) == (48, 40)
    too_long = {"max_tokens": 512}
    with pytest.raises(OrcaConfigError, match=r"max_tokens \(512\) exceeds the checkpoint's context of 128"):
        OrcaConfig.from_dict(too_long).fitted_to(128, too_long)


def test_a_context_with_no_room_to_generate_is_refused():
    with pytest.raises(OrcaConfigError, match="no room"):
        OrcaConfig().fitted_to(1, given={})
