"""`specdecode serve`'s Ray flags (cli/serve_ray.py): refused without --ray (needs no Ray), and bad
autoscaling bounds refused by flag name before anything starts (marked ray: needs Ray installed,
though nothing is started)."""

import pytest

from specdecode import cli


@pytest.mark.parametrize(("flags", "pattern"), [
    (["--replicas", "2"], "--replicas apply to Ray Serve: add --ray"),
    (["--min-replicas", "1", "--ray-address", "auto"], "--min-replicas, --ray-address apply to Ray Serve"),
    (["--cpus-per-replica", "2"], "--cpus-per-replica apply to Ray Serve"),
])
def test_ray_flags_without_ray_are_refused(capsys, flags: list[str], pattern: str) -> None:
    assert cli.main(["serve", *flags]) == cli.EXIT_USER_ERROR
    assert pattern in capsys.readouterr().err


@pytest.mark.ray  # RayOptions, which checks the bounds, lives in serving.ray and needs Ray installed
@pytest.mark.parametrize(("flags", "pattern"), [
    (["--min-replicas", "3", "--max-replicas", "2"], "--min-replicas (3) must not exceed --max-replicas (2)"),
    (["--replicas", "5", "--max-replicas", "2"],
     "--replicas (5) must lie between --min-replicas (1) and --max-replicas (2)"),
    (["--target-ongoing-requests", "4"], "--target-ongoing-requests applies to autoscaling"),
])
def test_bad_autoscaling_bounds_are_refused_by_flag_name(capsys, flags: list[str], pattern: str) -> None:
    pytest.importorskip("ray.serve")  # the bounds are checked by serving.ray's RayOptions
    assert cli.main(["serve", "--ray", *flags]) == cli.EXIT_USER_ERROR
    assert pattern in capsys.readouterr().err
