"""``requests`` without a character-set guesser.

requests imports charset_normalizer (or chardet) to guess the encoding of a text answer that
names none: about 1 MB resident in every process that talks to a registry (the agent on every
node), and 0.1 s of each ``accelnode cache`` command's start. We never read an answer as guessed
text: every body is bytes, parsed by accelnode/decode.py. So requests is imported here with the
guessers hidden (requests then takes such text as UTF-8, and says nothing); the hiding ends with
the import, so any other library of the process still finds them.
"""

from __future__ import annotations

import sys
import warnings

_GUESSERS = ("charset_normalizer", "chardet")

if "requests" not in sys.modules:
    _hidden = [name for name in _GUESSERS if name not in sys.modules]
    for _name in _hidden:
        sys.modules[_name] = None  # what an import of an absent module meets: ImportError
    try:
        with warnings.catch_warnings():  # requests warns that it found no guesser: we mean it
            warnings.simplefilter("ignore")
            import requests
    finally:
        for _name in _hidden:
            if sys.modules.get(_name, ...) is None:
                del sys.modules[_name]

import requests  # noqa: E402,F811 - the module now imported, whichever way

__all__ = ["requests"]
