"""Stop-string matching on incrementally detokenized text."""

from __future__ import annotations


def find_stop_string(
    text: str, num_new_chars: int, stop: list[str], include_stop_str_in_output: bool
) -> tuple[str, int] | None:
    """Returns (stop string, length to truncate text to) for the earliest stop string that
    ends inside the last `num_new_chars` characters of `text`, or None.

    Only matches ending in the new text count: one wholly inside the older text would have
    been found on an earlier step. So each stop string s is searched from
    len(text) - num_new_chars - (len(s) - 1), which also finds s split across steps:

        text:  ....older text....|..new..
                          [ s  ]          <- starts up to len(s)-1 chars before the new text
    """
    num_old_chars = len(text) - num_new_chars
    best: tuple[str, int] | None = None
    for s in stop:
        i = text.find(s, max(0, num_old_chars - len(s) + 1))
        # Earliest start wins; on a tie the first listed stop string wins.
        if i != -1 and (best is None or i < best[1]):
            best = (s, i)
    if best is None:
        return None
    s, i = best
    return s, (i + len(s) if include_stop_str_in_output else i)


def stop_hold_back(stop: list[str] | None, include_stop_str_in_output: bool) -> int:
    """How many trailing characters a streaming output withholds until the request finishes.

    The last max(len(stop)) - 1 characters may be the start of a stop string that the next
    token completes; they would then be cut, so a user must not see them yet. When the stop
    string is kept in the output, nothing already shown can be cut, so nothing is held.
    """
    if not stop or include_stop_str_in_output:
        return 0
    return max(len(s) for s in stop) - 1
