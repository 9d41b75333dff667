// Live dashboard: draws each snapshot the server pushes over the WebSocket.
// The figures are drawn like queues/dashboard/display.py draws them on the server: change both together.
"use strict";

(function () {
  const root = document.querySelector("[data-dashboard]");
  if (!root) return;

  const STATES = ["scheduled", "pending", "processing", "finished", "failed"];
  const MAX_RETRY_MS = 30000;
  const rows = root.querySelector("[data-rows]");
  const table = rows.closest("table");
  const empty = root.querySelector("[data-empty]");
  const rowTemplate = root.querySelector("[data-row-template]").content.querySelector("tr");
  const workerRows = root.querySelector("[data-worker-rows]");
  const workerTable = workerRows.closest("table");
  const workersEmpty = root.querySelector("[data-workers-empty]");
  const workersCount = root.querySelector("[data-workers-count]");
  const workerTemplate = root.querySelector("[data-worker-template]").content.querySelector("tr");
  const status = document.querySelector("[data-live-status]");
  const statusText = document.querySelector("[data-live-text]");
  const liveAt = document.querySelector("[data-live-at]");
  const offline = document.querySelector("[data-live-offline]");

  function formatDuration(seconds) {
    if (seconds === null || seconds === undefined) return "–";
    const whole = Math.max(0, Math.floor(seconds));
    const units = [["d", 86400, "h", 3600], ["h", 3600, "min", 60], ["min", 60, "s", 1]];
    for (const [unit, size, smaller, smallerSize] of units) {
      if (whole >= size) {
        const rest = Math.floor((whole % size) / smallerSize);
        return `${Math.floor(whole / size)} ${unit}` + (rest ? ` ${rest} ${smaller}` : "");
      }
    }
    return `${whole} s`;
  }

  function percent(part, whole) {
    return whole ? Math.round((10000 * part) / whole) / 100 : 0;
  }

  function drawChart(chart, throughput) {
    const peak = Math.max(0, ...throughput.map((minute) => minute.finished + minute.failed));
    while (chart.children.length < throughput.length) {
      const column = document.createElement("span");
      column.className = "th-col";
      for (const state of ["failed", "finished"]) {
        const part = document.createElement("span");
        part.className = `th-${state}`;
        column.append(part);
      }
      chart.append(column);
    }
    while (chart.children.length > throughput.length) chart.lastElementChild.remove();
    throughput.forEach((minute, index) => {
      const column = chart.children[index];
      column.title = `${minute.minute.slice(11, 16)} UTC: ${minute.finished} finished, ${minute.failed} failed`;
      column.querySelector(".th-failed").style.height = `${percent(minute.failed, peak)}%`;
      column.querySelector(".th-finished").style.height = `${percent(minute.finished, peak)}%`;
    });
  }

  function fillRow(row, queue) {
    const counts = queue.counts;
    const total = STATES.reduce((sum, state) => sum + counts[state], 0);
    const field = (name) => row.querySelector(`[data-field="${name}"]`);
    row.dataset.queue = queue.name;
    row.classList.toggle("th-is-paused", queue.paused);
    field("link").textContent = queue.name;
    field("link").href = root.dataset.queueUrl.replace("__queue__", encodeURIComponent(queue.name));
    field("paused").hidden = !queue.paused;
    for (const state of STATES) {
      row.querySelector(`[data-segment="${state}"]`).style.width = `${percent(counts[state], total)}%`;
      row.querySelector(`[data-count="${state}"]`).textContent = counts[state];
    }
    field("bar").setAttribute("aria-label", STATES.map((state) => `${counts[state]} ${state}`).join(", "));
    field("errors").hidden = !queue.errorResults;
    field("errors").textContent = `of the finished, ${queue.errorResults} with an error result`;
    field("oldest").textContent = formatDuration(queue.oldestPendingAgeSeconds);
    drawChart(field("chart"), queue.throughput);
    field("rate").textContent = `${queue.lastMinute.finished} finished, ${queue.lastMinute.failed} failed`;
    field("workers").textContent = `${queue.workers} worker${queue.workers === 1 ? "" : "s"}`;
  }

  function itemLink(item) {
    const link = document.createElement("a");
    link.className = "th-id";
    link.href = root.dataset.itemUrl
      .replace("__queue__", encodeURIComponent(item.queue))
      .replace("__item__", encodeURIComponent(item.id));
    link.title = `${item.queue} ${item.id}`;
    link.textContent = item.id.slice(-8);
    return link;
  }

  function fillWorker(row, worker, now) {
    const field = (name) => row.querySelector(`[data-field="${name}"]`);
    row.dataset.worker = worker.id;
    field("name").textContent = worker.name;
    field("address").textContent = worker.address;
    field("queues").textContent = worker.queues.join(", ");
    const since = field("since");
    since.dateTime = worker.connectedAt;
    since.title = `since ${worker.connectedAt.slice(0, 19).replace("T", " ")} UTC`;
    since.textContent = formatDuration((now - Date.parse(worker.connectedAt)) / 1000);
    field("holding").textContent = worker.holding;
    const links = worker.held.flatMap((item) => [itemLink(item), " "]);
    const more = worker.holding - worker.held.length;
    if (more > 0) {
      const rest = document.createElement("span");
      rest.className = "th-quiet";
      rest.textContent = `and ${more} more`;
      links.push(rest);
    }
    field("held").replaceChildren(...links);
  }

  function renderWorkers(workers, at) {
    const now = Date.parse(at);
    const shown = new Set();
    workers.forEach((worker, index) => {
      const row =
        workerRows.querySelector(`tr[data-worker="${CSS.escape(worker.id)}"]`) || workerTemplate.cloneNode(true);
      fillWorker(row, worker, now);
      if (workerRows.children[index] !== row) workerRows.insertBefore(row, workerRows.children[index] || null);
      shown.add(worker.id);
    });
    for (const row of [...workerRows.children]) {
      if (!shown.has(row.dataset.worker)) row.remove();
    }
    workerTable.hidden = workers.length === 0;
    workersEmpty.hidden = !workerTable.hidden;
    workersCount.textContent = workers.length;
  }

  function render(snapshot) {
    const shown = new Set();
    snapshot.queues.forEach((queue, index) => {
      const row =
        rows.querySelector(`tr[data-queue="${CSS.escape(queue.name)}"]`) || rowTemplate.cloneNode(true);
      fillRow(row, queue);
      if (rows.children[index] !== row) rows.insertBefore(row, rows.children[index] || null);
      shown.add(queue.name);
    });
    for (const row of [...rows.children]) {
      if (!shown.has(row.dataset.queue)) row.remove();
    }
    table.hidden = snapshot.queues.length === 0;
    empty.hidden = !table.hidden;
    renderWorkers(snapshot.workers, snapshot.at);
    liveAt.dateTime = snapshot.at;
    liveAt.textContent = `${snapshot.at.slice(11, 19)} UTC`;
  }

  function setStatus(state, text) {
    status.dataset.liveStatus = state;
    statusText.textContent = text;
    offline.hidden = state !== "offline";
  }

  let retryMs = 1000;
  function connect() {
    const scheme = location.protocol === "https:" ? "wss:" : "ws:";
    const socket = new WebSocket(`${scheme}//${location.host}${root.dataset.liveUrl}`);
    socket.addEventListener("open", () => {
      retryMs = 1000;
      setStatus("live", "Live");
    });
    socket.addEventListener("message", (event) => {
      const message = JSON.parse(event.data);
      if (message.type === "snapshot") render(message);
    });
    socket.addEventListener("close", () => {
      // Show the reload link at once, and keep trying to reconnect in the background.
      setStatus("offline", "Offline");
      setTimeout(connect, retryMs);
      retryMs = Math.min(retryMs * 2, MAX_RETRY_MS);
    });
  }

  connect();
})();
