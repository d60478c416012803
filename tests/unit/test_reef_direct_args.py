"""``bench.reef_direct --policies``: which workers one process holds, REEF always among them."""

from __future__ import annotations

import pytest

from bench.reef_direct import main


@pytest.mark.parametrize("policies", ["seq,concurrent", "reef,fifo", ""])
def test_a_policy_list_without_reef_or_with_an_unknown_policy_is_refused(policies, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--policies", policies])
    assert "reef among them" in capsys.readouterr().err
