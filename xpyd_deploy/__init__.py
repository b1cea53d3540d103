"""What runs and renders an xPyD deployment, shipped in the wheel: the topology model
(``topology.py``, one YAML file under configs/topologies/ per layout), the launcher that brings a
topology up on this machine (``launch.py``, ``xpyd launch``) and the renderers derived from the
same topologies (``compose.py``, ``k8s.py``, ``haproxy_cfg.py``); ``cli.py`` is the ``xpyd``
command. Imports ``proxy.config`` (k8s.py validates proxy flags) and nothing of ``connector/``
but the doctor, which ``xpyd doctor`` loads on demand; ``proxy/``, ``connector/`` and
``xpyd_wire/`` never import this package (tests/unit/test_deploy_layout.py)."""
