"""Hardware profiles in the store: versioned per node type, newest first, round-tripped unchanged."""

from __future__ import annotations

import pytest
from sqlalchemy.orm import Session, sessionmaker

from service.planner.efficiency import HardwareProfile
from service.store.profiles import (
    newest_profile,
    newest_profiles,
    profile_for,
    profile_summaries,
    save_profile,
)


def _doc(node_type: str = "cpu-virtual", rate: float = 1e10) -> dict:
    return {
        "node_type": node_type, "version": 0, "compute_dtype": "fp32",
        "matmul": {"fp32": [[64, 64, 64, rate / 4], [256, 256, 256, rate]]},
        "attention": [[128, 64, rate / 8]], "memory_bw": 5e9,
        "collectives": {"all_reduce": [[4096.0, 1e-4], [1048576.0, 1.1e-3]]}, "ranks": 2, "backend": "gloo",
        "meta": {"device": "cpu", "threads": 2},
    }  # fmt: skip


def test_profiles_are_versioned_per_node_type_and_round_trip(
    db_session_factory: sessionmaker[Session],
) -> None:
    with db_session_factory() as s:
        assert newest_profile(s, "cpu-virtual") is None
        first = save_profile(s, _doc(rate=1e10))
        second = save_profile(s, _doc(rate=2e10))
        other = save_profile(s, _doc("H100-80GB"))
        s.commit()
    assert (first.version, second.version, other.version) == (1, 2, 1)
    with db_session_factory() as s:
        got = newest_profile(s, "cpu-virtual")
        assert got == second
        assert got is not None and got.to_dict() == {
            **HardwareProfile.from_dict(_doc(rate=2e10)).to_dict(),
            "version": 2,
        }
        assert set(newest_profiles(s)) == {"cpu-virtual", "H100-80GB"}
        assert profile_for(s, "cpu") == second  # aliases resolve to the catalogue name
        assert profile_for(s, "no-such-gpu") is None
        summary = {p["node_type"]: p for p in profile_summaries(s)}
    assert summary["cpu-virtual"]["version"] == 2
    assert summary["cpu-virtual"]["matmul_tflops"]["fp32"] == pytest.approx(2e10 / 1e12)
    assert summary["cpu-virtual"]["all_reduce"]["gbps"] > 0


def test_a_malformed_profile_is_refused(db_session_factory: sessionmaker[Session]) -> None:
    doc = _doc()
    doc["compute_dtype"] = "bf16"  # no bf16 measurements
    with db_session_factory() as s, pytest.raises(ValueError, match="compute_dtype"):
        save_profile(s, doc)
