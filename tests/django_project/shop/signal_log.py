import os

from taskhoster.django.framework import task_finished, task_started


def _write(name, task_result, **kwargs):
    with open(os.environ["SIGNAL_LOG"], "a") as log:
        log.write(f"{name} {task_result.id} {task_result.status} {len(task_result.errors)}\n")


def on_started(sender, task_result, **kwargs):
    _write("started", task_result)


def on_finished(sender, task_result, **kwargs):
    _write("finished", task_result)


task_started.connect(on_started)
task_finished.connect(on_finished)
