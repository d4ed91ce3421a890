"""The commands: ``watchdogd serve|run`` (``main``, ``run``) and ``watchdogctl``
(``ctl``). Each ``main(argv=None) -> int`` builds one Config from its flags,
hands it to the layer below, and turns outcomes into exit codes; only this
package imports ``daemon``.
"""
