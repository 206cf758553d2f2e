"""The one reading of a yes/no switch in the environment (``EDDIS_WITH_UCX=off``).

Both the settings registry and setup.py read switches with it. setup.py runs
before the package is built and cannot import ``eddis``, so it loads this file
by path: it must stay free of imports from the package.
"""

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off", "")
ACCEPTED = "1/0, true/false, yes/no, on/off"


def parse_bool(text):
    """True or False for a switch's text; None for a text that is neither, so that the
    caller, which knows the variable, can name it in its error."""
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    return None
