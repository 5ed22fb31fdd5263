"""Progress bars redraw at tqdm's pace on a terminal and rarely into a file (a days-long study
under nohup keeps every redraw)."""

import io

from tqdm import tqdm

from nlq.progress import bar_interval


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_a_bar_into_a_file_redraws_rarely_and_on_a_terminal_at_tqdms_pace():
    assert bar_interval(_Tty()) == 0.1
    assert bar_interval(io.StringIO()) == 30.0

    # what that buys: 200 updates on a faked clock that ticks a second each time tqdm reads it
    # draw ~200 times at 0.1 s, under 15 times at 30 s (8 here)
    def draws(stream):
        clock = iter(range(10_000))
        bar = tqdm(total=200, file=stream, mininterval=bar_interval(stream), miniters=1)
        bar._time = lambda: float(next(clock))  # tqdm reads its clock through this attribute
        bar.start_t = bar.last_print_t = bar._time()
        for _ in range(200):
            bar.update(1)
        bar.close()
        return stream.getvalue().count("\r")

    assert draws(io.StringIO()) < 15
    assert draws(_Tty()) > 150
