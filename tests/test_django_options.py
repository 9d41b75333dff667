"""A TaskhosterBackend's settings: each mistake is an ImproperlyConfigured that says what to set."""

import pytest
from django.core.exceptions import ImproperlyConfigured

from taskhoster.django.options import Options

SERVER = {"url": "http://127.0.0.1:8000", "token": "th_x"}


def read(options: dict, queues=("default",)) -> Options:
    return Options.read("default", options, set(queues))


def test_defaults_retry_nothing_and_run_one_task_at_once():
    options = read(SERVER)
    assert (options.max_attempts, options.concurrency, options.queues) == (1, 1, ("default",))


def test_url_and_token_come_from_the_environment_when_not_given(monkeypatch):
    monkeypatch.setenv("TASKHOSTER_URL", "http://example.test:9000/")
    monkeypatch.setenv("TASKHOSTER_TOKEN", "th_env")
    options = read({})
    assert (options.url, options.token) == ("http://example.test:9000", "th_env")


def test_a_missing_token_says_where_to_put_one(monkeypatch):
    monkeypatch.delenv("TASKHOSTER_TOKEN", raising=False)
    with pytest.raises(ImproperlyConfigured, match=r"TASKS\[\"default\"\].*TASKHOSTER_TOKEN"):
        read({"url": SERVER["url"]})


@pytest.mark.parametrize("options, message", [
    ({"max_atempts": 3}, "unknown keys"),
    ({"max_attempts": 0}, "max_attempts"),
    ({"max_attempts": True}, "max_attempts"),
    ({"concurrency": 2.5}, "concurrency"),
    ({"retry_base": 0}, "retry_base"),
    ({"retry_base": 10, "retry_cap": 5}, "must be at least retry_base"),
    ({"timeout": "30"}, "timeout"),
])
def test_a_wrong_option_is_named(options, message):
    with pytest.raises(ImproperlyConfigured, match=message):
        read({**SERVER, **options})


@pytest.mark.parametrize("queues, message", [((), "must name the Taskhoster queues"),
                                             (("Default",), "not a Taskhoster queue name"),
                                             (("-x",), "not a Taskhoster queue name")])
def test_queues_must_be_named_and_valid(queues, message):
    with pytest.raises(ImproperlyConfigured, match=message):
        read(SERVER, queues)
