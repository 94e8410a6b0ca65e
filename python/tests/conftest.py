"""Shared fixtures of the Python tests: the built ``weightferry`` CLI, for comparing ``weightferry.plan`` with
``weightferry plan --json``. torch is imported unconditionally: without it these tests must fail, not skip."""

import json
import os
import pathlib
import subprocess

import pytest
import torch  # noqa: F401  (a missing torch is an error of the test environment)

REPO = pathlib.Path(__file__).resolve().parents[2]


def _cli_path():
    path = pathlib.Path(os.environ.get("WEIGHTFERRY_BIN", REPO / "target" / "debug" / "weightferry"))
    if not path.is_file():
        pytest.fail(f"the weightferry CLI is not built at {path}; run `cargo build` (or set WEIGHTFERRY_BIN)")
    return path


class Cli:
    """Runs ``weightferry plan`` on files."""

    def __init__(self, path):
        self.path = path

    def run(self, *args):
        return subprocess.run([str(self.path), *map(str, args)], capture_output=True, text=True, check=False)

    def plan(self, pipeline_file, config_file):
        """The report of ``weightferry plan --json`` as a dict (fails the test on a non-zero exit)."""
        r = self.run("plan", "--pipeline", pipeline_file, "--config", config_file, "--json")
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def plan_error(self, pipeline_file, config_file):
        """The error message of a failing ``weightferry plan --json`` (one JSON object on stderr, exit code 2)."""
        r = self.run("plan", "--pipeline", pipeline_file, "--config", config_file, "--json")
        assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
        (line,) = r.stderr.strip().splitlines()
        err = json.loads(line)
        assert err["exit_code"] == 2, err
        return err["error"]


@pytest.fixture(scope="session")
def cli():
    return Cli(_cli_path())
