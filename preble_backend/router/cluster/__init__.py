"""The router's state over all its engines and what changes it: the state and its verdicts
(``router_state``), engines joining and leaving (``membership``), a request moving on when
its engine dies (``migration``), and the operator's admin control (``admin``,
``admin_control``). Imports ``config``, ``engines`` and ``requests``."""
