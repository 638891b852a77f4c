"""Model classes SGLang loads instead of its built-ins (``SGLANG_EXTERNAL_MODEL_PACKAGE``).

SGLang imports every module of this package and registers each module's ``EntryClass`` under
the class's name, replacing the built-in class of that name. Keeping the built-in names keeps
SGLang's matching multimodal processors, which are looked up by class name.

The modules import SGLang, so only a worker process imports them; importing this package alone
does not.
"""

import logging

PACKAGE = __name__
# Logged once per model instance; tests and operators grep worker logs for it.
ACTIVE_LOG_PREFIX = "revisit model class active:"

logger = logging.getLogger(__name__)


def announce(model: object) -> None:
    cls = type(model)
    logger.info("%s %s.%s", ACTIVE_LOG_PREFIX, cls.__module__, cls.__qualname__)
