"""The dashboard in a real browser: headless Chromium against a real `manage.py serve`."""

import json
import re
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import expect, sync_playwright

from serverproc import Deployment

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PASSWORD = "a browser's password"
NEVER_POSTED = "0193a4b2-7c1e-7d3a-9f00-2b6c1d0e4f55"


@pytest.fixture
def site(tmp_path):
    """A served installation with a staff user, two queues and an API token."""
    deployment = Deployment(tmp_path / "site", extra_env={"DJANGO_SUPERUSER_PASSWORD": PASSWORD})
    deployment.migrate()
    deployment.manage("createsuperuser", "--no-input", "--username", "operator", "--email", "op@example.com")
    deployment.create_queue("thumbnails", "--lease-seconds", "300")
    deployment.create_queue("emails", "--paused")
    token = deployment.create_token("browser-test")
    with deployment.server() as server:
        api = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {token}"}, timeout=10)
        with api:
            yield deployment, server, api


@pytest.fixture
def browser_page():
    assert CHROMIUM.exists(), (
        f"Chromium is not installed at {CHROMIUM}: the browser test needs Debian's package "
        "(apt-get install -y chromium)."
    )
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1366, "height": 768})  # a laptop screen
            page.set_default_timeout(10_000)
            yield page
        finally:
            browser.close()


def test_staff_watch_the_dashboard_update_live_and_work_a_queue(site, browser_page, tmp_path):
    deployment, server, api = site
    page = browser_page
    problems = []
    page.on("console", lambda message: message.type == "error" and problems.append(message.text))
    page.on("pageerror", lambda error: problems.append(str(error)))

    # Log in: the dashboard sends an anonymous visitor to the login page first.
    page.goto(f"{server.url}/")
    expect(page).to_have_url(re.compile(r"/admin/login/\?next=/$"))
    page.get_by_label("Username").fill("operator")
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    expect(page.get_by_role("heading", name="Queues")).to_be_visible()
    expect(page.locator("[data-live-status]")).to_have_attribute("data-live-status", "live")

    thumbnails = page.locator('tr[data-queue="thumbnails"]')
    emails = page.locator('tr[data-queue="emails"]')
    expect(thumbnails.locator('[data-count="pending"]')).to_have_text("0")
    expect(emails.get_by_text("Paused")).to_be_visible()
    expect(thumbnails.get_by_text("Paused")).to_be_hidden()

    # Items posted through the API show up without a reload.
    page.evaluate("window.notReloaded = true")
    posted = api.post(
        "/api/queues/thumbnails/items",
        json={"items": [{"payload": {"image": f"cat-{n}.png", "sizes": [64, 128]}} for n in range(5)]},
    )
    assert posted.status_code == 201, posted.text
    expect(thumbnails.locator('[data-count="pending"]')).to_have_text("5")

    claimed = api.post("/api/queues/thumbnails/claim", json={"max": 3})
    assert claimed.status_code == 200, claimed.text
    done = claimed.json()["items"][0]["id"]
    answer = api.post(f"/api/queues/thumbnails/items/{done}/result", json={"result": {"ok": True}})
    assert answer.json()["accepted"] is True
    expect(thumbnails.locator('[data-count="processing"]')).to_have_text("2")
    expect(thumbnails.locator('[data-count="finished"]')).to_have_text("1")
    expect(thumbnails.locator('[data-field="rate"]')).to_have_text("1 finished, 0 failed")

    # A queue made meanwhile gets its own row, in name order.
    deployment.create_queue("reports")
    expect(page.locator("tbody[data-rows] tr")).to_have_count(3)
    assert page.locator("tbody[data-rows] tr").evaluate_all("rows => rows.map(r => r.dataset.queue)") == [
        "emails",
        "reports",
        "thumbnails",
    ]
    expect(page.locator('tr[data-queue="reports"]').get_by_role("link", name="reports")).to_have_attribute(
        "href", "/queues/reports/"
    )
    assert page.evaluate("window.notReloaded") is True
    page.screenshot(path=tmp_path / "dashboard.png", full_page=True)

    # The queue's pages: the item list, one item's payload and result.
    thumbnails.get_by_role("link", name="thumbnails").click()
    expect(page.get_by_role("heading", name="Queue thumbnails")).to_be_visible()
    expect(page.locator(".th-items tbody tr")).to_have_count(2)  # pending, newest first
    page.screenshot(path=tmp_path / "queue.png", full_page=True)
    page.get_by_role("link", name=re.compile(r"Done")).click()
    page.get_by_role("link", name=done).click()
    expect(page.get_by_label("Result")).to_have_text('{\n  "ok": true\n}')
    expect(page.get_by_label("Payload")).to_contain_text('"image": "cat-')
    page.screenshot(path=tmp_path / "item.png", full_page=True)

    # Re-queue a processing item now, from the keyboard.
    page.get_by_role("link", name="thumbnails").first.click()
    page.get_by_role("link", name=re.compile(r"Processing")).click()
    page.get_by_role("button", name="Re-queue now").first.focus()
    page.keyboard.press("Enter")
    expect(page.get_by_text("is pending again")).to_be_visible()
    expect(page.locator(".th-items tbody tr")).to_have_count(1)

    # Pause and resume the queue; the API sees each change.
    page.get_by_role("button", name="Pause queue").click()
    expect(page.get_by_text("Queue thumbnails is paused")).to_be_visible()
    assert api.get("/api/queues/thumbnails").json()["paused"] is True
    page.get_by_role("button", name="Resume queue").click()
    expect(page.get_by_text("Queue thumbnails is running again")).to_be_visible()
    assert api.get("/api/queues/thumbnails").json()["paused"] is False

    assert problems == [], f"the browser console reported errors: {problems}"

    # A gone item is a clear page (its 404 status is the one console line it adds), not an error.
    page.goto(f"{server.url}/queues/thumbnails/items/{NEVER_POSTED}/")
    expect(page.get_by_role("heading", name="Item gone")).to_be_visible()

    # When the server goes away, the dashboard says so and offers a reload link.
    page.goto(f"{server.url}/")
    expect(page.locator("[data-live-status]")).to_have_attribute("data-live-status", "live")
    server.stop()
    expect(page.get_by_role("link", name="Reload the page")).to_be_visible()
    expect(page.locator("[data-live-status]")).to_have_attribute("data-live-status", "offline")


def no_horizontal_overflow(page) -> bool:
    return page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")


def test_on_a_phone_the_pages_fit_and_workers_and_new_queues_are_at_hand(site, browser_page, tmp_path):
    """At 390 px wide nothing scrolls sideways; a worker that connects shows up live, with what it
    holds; a queue is made from the dashboard."""
    from websockets.sync.client import connect

    deployment, server, api = site
    page = browser_page
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(f"{server.url}/")
    page.get_by_label("Username").fill("operator")
    page.get_by_label("Password").fill(PASSWORD)
    page.get_by_role("button", name="Log in").click()
    expect(page.locator("[data-live-status]")).to_have_attribute("data-live-status", "live")
    expect(page.get_by_text("No worker is connected")).to_be_visible()

    long_payload = {"image": "a-rather-long-file-name-" * 8 + ".png", "sizes": [64, 128, 256, 512]}
    item_id = api.post("/api/queues/thumbnails/items", json={"payload": long_payload}).json()["id"]
    token = api.headers["Authorization"]
    with connect(server.ws_url, additional_headers={"Authorization": token}) as worker:
        worker.send('{"op": "claim", "queue": "thumbnails"}')
        assert item_id in worker.recv()
        workers = page.locator("tbody[data-worker-rows] tr")
        expect(workers).to_have_count(1)
        expect(workers.first).to_contain_text("browser-test")
        expect(workers.first.get_by_role("link", name=item_id[-8:])).to_have_attribute(
            "href", f"/queues/thumbnails/items/{item_id}/")
        expect(page.locator('tr[data-queue="thumbnails"] [data-field="workers"]')).to_have_text("1 worker")
        assert no_horizontal_overflow(page)
        page.screenshot(path=tmp_path / "phone-dashboard.png", full_page=True)
        error = {"error": {"type": "ValueError", "message": "no such image",
                           "traceback": "Traceback (most recent call last):\n  File \"handler.py\", line 3\n" * 5}}
        worker.send(json.dumps({"op": "result", "queue": "thumbnails", "id": item_id, "result": error}))
        assert '"accepted":true' in worker.recv()
    expect(page.get_by_text("No worker is connected")).to_be_visible()

    page.goto(f"{server.url}/queues/thumbnails/?state=done")
    expect(page.locator(".th-status")).to_have_text("error: ValueError")
    expect(page.locator(".th-preview")).to_contain_text('{"image":"a-rather-long')
    assert no_horizontal_overflow(page)
    page.screenshot(path=tmp_path / "phone-queue.png", full_page=True)
    page.get_by_role("link", name=item_id).click()
    expect(page.locator(".th-traceback")).to_contain_text('File "handler.py", line 3')
    assert no_horizontal_overflow(page)
    page.screenshot(path=tmp_path / "phone-item.png", full_page=True)

    page.goto(f"{server.url}/")
    page.get_by_text("New queue").click()
    page.get_by_label("Name").fill("invoices")
    page.get_by_label("Max attempts").fill("3")
    page.get_by_role("button", name="Make the queue").click()
    expect(page.get_by_role("heading", name="Queue invoices")).to_be_visible()
    assert api.get("/api/queues/invoices").json()["maxAttempts"] == 3
    assert no_horizontal_overflow(page)
