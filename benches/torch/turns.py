"""Overlapped variant processes with exclusive timing, for ``diffusers_bench.py --overlap``.

Each variant's process builds its model, enables it, compiles it and warms it up beside the other variants'
processes (compiling a full-size transformer takes minutes of mostly host time), then waits for its turn. The parent
gives the turns one at a time, in the order the variants were named, only once every process is ready or has ended,
so a variant's timed steps and its bandwidth probe never share the GPU with another variant's work: the waiting
processes hold memory and do nothing. A process not ready by the deadline is killed before the first turn.

The child side is two calls, :func:`wait_for_turn` before the timed steps and :func:`end_turn` once the variant has
measured everything; both do nothing unless the parent set ``WF_BENCH_TURNS``.
"""

import contextlib
import os
import signal
import subprocess
import tempfile
import time

ENV = "WF_BENCH_TURNS"


def wait_for_turn(name):
    """Child: says the variant ``name`` is warm, then blocks until the parent gives it the GPU."""
    folder = os.environ.get(ENV)
    if not folder:
        return
    open(os.path.join(folder, f"{name}.ready"), "w").close()
    turn = os.path.join(folder, "turn")
    while True:
        try:
            with open(turn) as f:
                if f.read() == name:
                    return
        except FileNotFoundError:
            pass
        time.sleep(0.05)


def end_turn(name):
    """Child: gives the GPU back (the variant's measurements are done; it prints and exits next)."""
    folder = os.environ.get(ENV)
    if folder:
        open(os.path.join(folder, f"{name}.done"), "w").close()


def _give_turn(folder, name):
    tmp = os.path.join(folder, "turn.tmp")
    with open(tmp, "w") as f:
        f.write(name)
    os.replace(tmp, os.path.join(folder, "turn"))


def _wait(pred, procs, names):
    """Polls until ``pred(name)`` holds or the process has ended, for each of ``names``."""
    while any(procs[n].poll() is None and not pred(n) for n in names):
        time.sleep(0.2)


def run_overlapped(cmds, deadline_s, on_end, stagger_s=0.0, hold=None):
    """Runs ``cmds`` (variant name -> argv) at once and times them in turns, calling ``on_end(name, exit code,
    stdout, stderr, seconds from the start)`` as each process ends (so a call cut short keeps what ended). A process
    not ready ``deadline_s`` after the start is killed (exit code ``-SIGKILL``). The first turn waits, too, until the
    file ``hold`` (other GPU work of the same call, which creates it and removes it when done) is gone."""
    folder = tempfile.mkdtemp(prefix="wf-turns-")
    env = dict(os.environ, **{ENV: folder})
    t0 = time.time()
    procs, files = {}, {}
    with contextlib.ExitStack() as stack:
        for i, (name, cmd) in enumerate(cmds.items()):
            if i and stagger_s:
                time.sleep(stagger_s)  # the builds' host memory peaks one after another
            out, err = (stack.enter_context(tempfile.TemporaryFile(mode="w+")) for _ in range(2))
            files[name] = (out, err)
            procs[name] = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, env=env)
        _take_turns(folder, procs, files, deadline_s - (time.time() - t0), on_end, hold, t0)


def _take_turns(folder, procs, files, deadline_s, on_end, hold, t0):
    """Waits for the processes to be warm (killing those that are not within ``deadline_s``) and for ``hold`` to
    go, then gives the turns in order."""
    start = time.time()

    def has(suffix):
        return lambda n: os.path.exists(os.path.join(folder, f"{n}.{suffix}"))

    while time.time() - start < deadline_s and any(procs[n].poll() is None and not has("ready")(n) for n in procs):
        time.sleep(0.2)
    for name, p in procs.items():
        if p.poll() is None and not has("ready")(name):
            p.send_signal(signal.SIGKILL)
            p.wait()
    while hold and os.path.exists(hold):
        time.sleep(0.2)
    print(f"turns: {sum(has('ready')(n) for n in procs)} of {len(procs)} variants warm after "
          f"{time.time() - t0:.0f} s", flush=True)
    for name, p in procs.items():
        if p.poll() is None:
            _give_turn(folder, name)
            _wait(has("done"), procs, [name])
            p.wait()
        out, err = files[name]
        out.seek(0)
        err.seek(0)
        on_end(name, p.returncode, out.read(), err.read(), time.time() - t0)
