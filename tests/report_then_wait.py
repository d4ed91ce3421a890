"""The tail of a worker script that reports, then runs until told to stop.

Used by the standby tests and ``bench/bench_standby.py``: the script before
it has set ``out`` (a directory) and ``report`` (a dict) and imported ``json``,
``os`` and ``time``. The report is written whole (renamed into place) as
``out/PID.json``, then the worker runs until ``out/done`` exists.
"""

REPORT_THEN_WAIT = """
path = os.path.join(out, f"{os.getpid()}.json")
with open(path + ".part", "w") as f:
    json.dump(report, f)
os.rename(path + ".part", path)
while not os.path.exists(os.path.join(out, "done")):
    time.sleep(0.05)
"""
