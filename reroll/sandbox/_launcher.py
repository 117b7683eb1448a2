"""The launcher that runs inside every sandbox (never imported by the host).

The host starts ``python -I [-S] -B -c <this file's source> <fd>`` inside the sandbox. The launcher
signals readiness with one byte on the channel ``fd``, reads one job (a ``marshal`` dict) until
end-of-file and acknowledges it with another byte, then — before any untrusted code runs — closes every descriptor but 0, 1 and 2,
writes the job's files into the private workdir, replaces the environment and applies the
rlimits. It then forks the program: the child either ``exec``s the job's argv or runs the job's
Python code as ``__main__`` in the already started interpreter — the start-up is paid before the
job arrives, which is what makes a warm sandbox fast. A sandbox runs exactly one job.

The launcher is the init (pid 1) of the sandbox's pid namespace (bubblewrap ``--as-pid-1``): it
reaps every process and exits with the program's status (128 + N for signal N) as soon as the
program ends, which makes the kernel kill whatever the program left running. Because the host
waits for this init, the kernel's resource accounting (CPU time, peak memory) of the whole tree
reaches the host. As init it ignores every signal sent from inside the sandbox, and it makes
itself non-dumpable (``PR_SET_DUMPABLE`` 0) before it reads a job, so the program, which runs as
the same uid, can neither ptrace it nor open its ``/proc/1/mem`` (a stalled init would turn the
program's own exit into a wall-clock kill).

Only built-in modules are used (and ``ctypes`` for prctl, ~3 ms), so the start-up stays small. Nothing here is trusted by the host:
results are observed from outside (exit status, resource usage, pipes).
"""

import _signal
import builtins
import marshal
import os
import resource
import sys

_PR_SET_DUMPABLE = 4


def _set_dumpable(value):
    import ctypes

    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE) failed")


def _read_job(fd):
    os.write(fd, b"R")
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        chunks.append(chunk)
    os.write(fd, b"J")  # job received: from here on, the outcome is the program's
    os.close(fd)
    return marshal.loads(b"".join(chunks))


def _prepare(job):
    os.closerange(3, 1 << 16)
    workdir = job["workdir"]
    for rel, data in job["files"].items():
        path = os.path.join(workdir, rel)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as handle:
                handle.write(data)
        except OSError as exc:
            sys.stderr.write(f"sandbox: cannot write {rel!r} into the workdir: {exc}\n")
            raise SystemExit(126) from None
    os.chdir(workdir)
    # The sandboxed program's environment, exactly the job's (reroll.settings governs the host's
    # variables; this file runs inside the sandbox and may import built-in modules only).
    os.environ.clear()
    os.environ.update(job["env"])
    for rid, soft, hard in job["rlimits"]:
        resource.setrlimit(rid, (soft, hard))


def _run_code(source, path, workdir):
    main = type(sys)("__main__")
    main.__file__ = path
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    sys.argv = [path]
    sys.path.insert(0, workdir)
    if not hasattr(builtins, "exit"):
        builtins.exit = builtins.quit = sys.exit
    try:
        exec(compile(source, path, "exec"), main.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        sys.__excepthook__(type(exc), exc.with_traceback(tb), tb)
        raise SystemExit(1) from None


def _program(job):
    """Runs in the forked child: becomes the program."""
    _signal.signal(_signal.SIGINT, _signal.default_int_handler)
    if job["argv"] is not None:
        argv = job["argv"]
        for sig in (_signal.SIGPIPE, _signal.SIGXFSZ):
            _signal.signal(sig, _signal.SIG_DFL)
        try:
            os.execvpe(argv[0], argv, job["env"])
        except OSError as exc:
            sys.stderr.write(f"sandbox: cannot execute {argv[0]!r}: {exc}\n")
            raise SystemExit(127) from None
    source = job["code"]
    del job
    _set_dumpable(1)  # the program itself is an ordinary process (its init stays protected)
    _run_code(source, os.path.join(os.getcwd(), "main.py"), os.getcwd())


def _reap_until(child):
    """Reap every process until ``child`` ends; return its status as a shell reports it."""
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            return 255
        if pid == child:
            return (
                os.waitstatus_to_exitcode(status)
                if os.WIFEXITED(status)
                else 128 + os.WTERMSIG(status)
            )


def _main():
    _set_dumpable(0)
    job = _read_job(int(sys.argv[1]))
    _prepare(job)
    _signal.signal(_signal.SIGINT, _signal.SIG_DFL)
    sys.stdout.flush()
    child = os.fork()
    if child == 0:
        _program(job)
        return
    del job
    os._exit(_reap_until(child))


_main()
