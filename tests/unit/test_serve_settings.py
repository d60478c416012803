"""``packrat serve``'s settings: a few flags a user may change, every other field through ``--tune``."""

from __future__ import annotations

import pytest

from packrat_plugin.cli import build_parser
from packrat_plugin.serve import config_from


def config(*flags: str):
    return config_from(build_parser().parse_args(["serve", "--models", "m=m.mar", *flags]))


def test_the_defaults_are_the_dataclasses_defaults():
    from packrat_plugin.model_control import ControllerConfig

    assert config() == ControllerConfig(swapper=config().swapper)  # max_batch_delay comes from its own flag
    assert config().swapper.max_batch_delay_ms == 5


def test_tune_sets_any_plain_field_of_each_section_with_its_type():
    tunes = [
        "monitor.period_s=0.5",
        "policy.up_rule=expected",
        "swapper.narrow_drains=true",
        "controller.credit_batches=false",
        "monitor.change_false_alarm_s=none",
        "calibration.min_requests=40",
    ]
    c = config(*[f"--tune={t}" for t in tunes], "--min-gain", "0.2")
    assert c.monitor.period_s == 0.5 and c.policy.up_rule == "expected" and c.swapper.narrow_drains
    assert c.credit_batches is False and c.monitor.change_false_alarm_s is None
    assert c.calibration.min_requests == 40 and c.policy.min_gain == 0.2


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("nonsense", "SECTION.FIELD=VALUE"),
        ("planner.x=1", "SECTION one of policy"),
        ("policy.no_such_field=1", "policy has no field 'no_such_field'"),
        ("controller.policy=1", "controller has no field 'policy'"),  # a section, not a plain field
        ("swapper.narrow_drains=maybe", "expected true or false"),
        ("calibration.min_requests=many", "--tune calibration.min_requests"),
        ("policy.up_rule=sideways", "up_rule must be one of"),  # the dataclass's own check
    ],
)
def test_a_bad_tune_names_what_is_wrong(value, says):
    with pytest.raises(ValueError, match=says.replace(".", r"\.").replace("(", r"\(")):
        config("--tune", value)


def test_serve_lists_six_policy_flags_where_it_listed_twenty_one():
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    section = help_text.split("reconfiguration policy")[1].split("several models")[0]
    flags = {line.split()[0] for line in section.splitlines() if line.strip().startswith("--")}
    assert flags == {"--up-confirm", "--down-confirm", "--min-gain", "--standby-workers", "--no-calibrate", "--tune"}


def test_a_missing_log_config_is_refused_in_one_line_before_anything_is_profiled_or_started(tmp_path, capsys):
    from packrat_plugin.cli import main

    archive = tmp_path / "m.mar"  # never read: the log config is checked first
    missing = tmp_path / "nowhere" / "log4j2.xml"
    work = tmp_path / "work"
    code = main(["serve", "--models", f"m={archive}", "--workdir", str(work), "--log-config", str(missing)])
    err = capsys.readouterr().err
    assert code == 2 and err.strip() == f"packrat serve: error: --log-config: no log4j2 file at {missing}"
    assert not work.exists()  # no TorchServe workdir was made
