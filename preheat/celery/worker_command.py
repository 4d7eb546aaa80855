"""`preheat-worker`: a worker of the preheat app, started by Celery's own `worker` command
without the `celery` umbrella around it.

`celery -A preheat worker` builds every `celery` subcommand and loads each plugin installed
beside it (Flower's, and click-repl with its prompt toolkit for `celery amqp`) before the
worker starts: 0.26-0.30 s of every worker's start on the 2-core machine, about 5 % of a
135 M model's launch-to-ready. Here Celery's `worker` command runs alone, with all of its
options, parsed and honoured by Celery itself: `preheat-worker --pool=threads -n gpu0@%h` is
`celery -A preheat worker --pool=threads -n gpu0@%h`, sooner. Both stay supported.
"""

from __future__ import annotations

import sys

from preheat.core import startheap


def main(argv: list[str] | None = None) -> None:
    startheap.hold_collector()  # before the imports: the start-up heap is built from here on
    from celery.bin.base import CLIContext
    from celery.bin.worker import worker

    from preheat.celery.app import app

    # What the umbrella command adds to `worker` before running it: the app's own options.
    worker.params.extend(app.user_options.get("worker", []))
    worker.main(
        args=sys.argv[1:] if argv is None else argv,
        prog_name="preheat-worker",
        obj=CLIContext(app=app, no_color=None, workdir=None),
    )


if __name__ == "__main__":
    main()
