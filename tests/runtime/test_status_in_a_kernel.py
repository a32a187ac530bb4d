"""``%gpu status`` and the widget's text in a real notebook kernel.

In a kernel, rich would draw a console's output as a display of its own: the status
tables then showed above the live widget (twice the page), and ``as_text()`` returned
"".  Here the kernel shows the widget alone, with the tables only as its plain-text
form, and ``as_text()`` returns them.  A real ipykernel kernel, a real broker on the
simulated H200 inventory (no GPU here).
"""

from __future__ import annotations


def test_status_is_the_widget_alone(on_broker, kernels):
    (kernel,) = kernels(1)
    kernel.run("%load_ext gpushare_ext").ok()
    shown = kernel.run("%gpu status").ok()
    assert [o["kind"] for o in shown.outputs] == ["data"], shown.describe()
    (widget,) = shown.outputs
    assert "H200" in widget["text"]  # its plain-text form: the tables of gpushare status


def test_as_text_returns_the_tables_and_shows_nothing(on_broker, kernels):
    (kernel,) = kernels(1)
    kernel.run("%load_ext gpushare_ext").ok()
    run = kernel.run(
        "import gpushare_ext\n"
        "w = gpushare_ext.widget()\n"
        "text = w.as_text()\n"
        "w.close()\n"
        "print('H200' in text, len(text.splitlines()) > 2)"
    ).ok()
    assert [o["kind"] for o in run.outputs] == ["stream"], run.describe()
    assert run.final_text().strip() == "True True", run.describe()
