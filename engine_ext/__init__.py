"""What runs next to, or inside, the SGLang workers behind the gateway.

- :mod:`engine_ext.bundled`: the project's own small models, built offline from recipes.
- :mod:`engine_ext.launcher`: start, watch and stop unmodified SGLang workers (CPU or GPU).
- :mod:`engine_ext.models`: model classes SGLang loads in place of its built-ins.
- :mod:`engine_ext.cpu_support`: what SGLang needs to serve on a CPU-only host.

Importing this package, the launcher or the models package alone pulls in neither torch nor
SGLang; building bundled models needs the ``engine`` extra.
"""
