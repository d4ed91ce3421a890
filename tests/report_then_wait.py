"""Pieces of worker scripts that report, then run until told to stop.

Used by the standby and quarantine tests and ``bench/bench_standby.py``.
:data:`ANCESTORS` defines ``ancestors()``, the pids above the worker (a test
names each agent by its pid). :data:`REPORT` writes ``report`` (a dict) whole
(renamed into place) as ``out/PID.json``; :data:`REPORT_THEN_WAIT` then runs
until ``out/done`` exists. :data:`REPORT_RANK` reports the rank's place
(``RANK``, ``GROUP_RANK``, the restart count), start time and ancestors.
The script before them has set ``out`` (a directory) and imported ``json``, ``os`` and ``time``.
"""

ANCESTORS = """
def ancestors():
    pid, found = os.getpid(), []
    while pid > 1:
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])
        found.append(pid)
    return found
"""

REPORT = """
path = os.path.join(out, f"{os.getpid()}.json")
with open(path + ".part", "w") as f:
    json.dump(report, f)
os.rename(path + ".part", path)
"""

REPORT_RANK = (
    ANCESTORS
    + """
report = {k: os.environ[k] for k in ("RANK", "GROUP_RANK", "TORCHELASTIC_RESTART_COUNT")}
report.update(started=time.time(), ancestors=ancestors())
"""
    + REPORT
)

REPORT_THEN_WAIT = (
    REPORT
    + """
while not os.path.exists(os.path.join(out, "done")):
    time.sleep(0.05)
"""
)
