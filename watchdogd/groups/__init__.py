"""Worker groups: the supervisor and its group runners, worker output, and the
rendezvous that places a group in its job (static and etcd behind one
interface, ``rendezvous.Rendezvous``).

The rule: a group learns of exits from pidfds on the loop and never waits for
a process there; its output is copied without blocking the loop (threads
write files and the console). ``groups`` talks to the timer service only
through ``core.ports`` (it implements ``Supervision`` and ``GroupControl``),
and never imports ``service``, ``cli`` or ``daemon``.
"""
