"""The bench's JSON line, explained (KEYS, shown by `manage.py bench --help`); the ratios made
from its figures; and the summary printed for a reader on stderr."""

KEYS = """\
The JSON line (one line on stdout; progress and a readable summary go to stderr):
  settings     what was run: sizes, measures, fsync modes, server, tmpdir, peers' versions, how
               the peers' workers and concurrent producers are set up
  disk.flushMs {p50, p99}: one 200-byte file written, fsynced, its directory fsynced, in
               TMPDIR; no post answered with fsync on can be faster than this
  disk.createUs {p50, p99}: making that file alone, in microseconds: every post and result
               makes one; on ext4 without a journal it grows with the files deleted in the last
               minutes, so a high figure says the disk was not rested (docs/performance.md)
  clientCpu    the client library's own CPU (user + system) per call, mean ms over --cpu-calls
               calls after untimed ones, in a process holding only the client, against stub
               servers in a process of their own (no Taskhoster server: it runs with --url too):
      producerPostMs       Producer.post, one item a call
      asyncProducerPostMs  AsyncProducer.post, awaited one at a time
      producerResultMs     Producer.result of an item that has ended (one GET)
      workerItemMs         a Worker per item, a plain no-op handler, one item at a time (the
                           defaults): its claim, handler thread, result and ack
      workerBatchedItemMs  the same with an async no-op handler, up to 100 items a claim (as the
                           bench's worker processes run)
  taskhoster."fsync on" | "fsync off" | "at url" (a server given by --url):
    client       through our own client, Producer and 2 Worker processes (what users see):
      enqueuePerSecond     --items single posts, one Producer.post each, while the workers consume
      endToEndPerSecond    the same items, from the first post until every result is in
      roundTripMs          {p50, p95, p99}: Producer.post, a Worker, Producer.result(), one at a time
      concurrentProducers  {"N": {postsPerSecond, postMs {p50, p99}, posts}}: N threads with a Producer
                           each, posting single items to a queue no worker works
      postManyItemsPerSecond  Producer.post_many, --batch items a call, to that queue
      endToEndInBatchesPerSecond  --items posted by Producer.post_many, --batch a call, while the
                           workers consume, from the first post until every result is in
      keyed                {singlePostsPerSecond, postManyItemsPerSecond}: each {plain, keyed},
                           Producer.post and post_many with a new idempotency key per item and
                           without, in alternating turns, to that queue
      serverCpuMs          {perItemEndToEnd, perPostNProducers}: the server's CPU (all its
                           threads) per item of the end-to-end run, and per post of N producers
                           (servers the bench started only)
    serverAlone  the same server driven by a lean raw-socket producer (no HTTP library):
      singlePostsPerSecond, batchPostItemsPerSecond  one connection, to the unworked queue
      refusedPostsPerSecond  posts without a token (401): what a trivial request costs through
                           this server, a ceiling for any post
      endToEndInBatchesPerSecond  --items posted --batch at a time while the workers consume
      roundTripMs          {p50, p95, p99}, post then a held GET until the item is done
      bigQueue             {pending, firstClaimMs, claimMs, serverPeakMemoryMB}: a fresh server
                           on the biggest queue of --pending-sizes
  storeAlone   the store without a server: claimMicroseconds {"fsync on": {"PENDING": us}},
               quietSweepSeconds {"PENDING": s}, and
    scheduled  {items, claimMicroseconds, postMicroseconds, quietSweepMs}: each {without, with}
               `items` scheduled items waiting for later (fsync off); dueTogether {items,
               allPendingSeconds {"fsync on"}}: from the second they all come due until a fresh
               process's promoter has them all pending
    keys       {items, newKeyMicroseconds, repeatMicroseconds}: each {"10", "ITEMS"}: a one-item
               post with a new key, and one repeating a key, beside 10 and `items` keyed items
               (fsync off)
  peers."celery (redis in memory)" | "celery (redis aof always)" | "rq (...)" | ...
               the users' workload through each library's normal API, with the same keys as
               taskhoster.*.client, each with the measure of ours it stands beside:
               enqueuePerSecond, endToEndPerSecond, roundTripMs; concurrentProducers, the same
               threads and seconds as ours, with no worker running as ours (task.delay,
               queue.enqueue)
  ratios       every ratio above 1 means Taskhoster is better:
    taskhosterVsPeers."fsync on"."celery (redis in memory)":
      enqueueOursOverTheirs, endToEndOursOverTheirs      our client's items/s over theirs (end to
                                                         end only when our workers claimed one item
                                                         at a time, as the peers' take one task)
      roundTripP50TheirsOverOurs (P95, P99)              their round trip over ours
      concurrentProducersOursOverTheirs {"N": ratio}     our posts/s with N threads over theirs
    batchesOverSingles."fsync on": {client, serverAlone}: items/s posted in batches over single
               posts of one producer, each against our own singles only (never a peer's)
  floors."fsync on"  about what this run's disk and server allow at best, with nothing else
               running (needs disk and server-posts):
      flushMs, trivialRequestMs  the disk's flush (disk.flushMs p50), and a trivial request
                           through the server from the lean client (1 / refusedPostsPerSecond)
      postMs               one producer's single post: the two together, as the post must wait
                           for its flush and make a request (our Producer's own CPU not added)
      postsPerSecond       1000 / postMs: one producer posting one item at a time, about the most
      roundTripMs          two of each (the post's flush and request, and the worker's
                           result's); what else a round trip holds is not counted
"""

PEER_KEYS = ("enqueuePerSecond", "endToEndPerSecond")
WORKLOAD_KEYS = {*PEER_KEYS, "roundTripMs"}
CUTS = ("p50", "p95", "p99")


def ratios(figures: dict) -> dict:
    """The ratios of KEYS, from whatever figures are there."""
    ours, theirs = figures.get("taskhoster", {}), figures.get("peers", {})
    # workers claiming several items at once against the peers' one task at a time: not a ratio
    one_at_a_time = figures.get("settings", {}).get("claimBatch") == 1
    keys = PEER_KEYS if one_at_a_time else tuple(key for key in PEER_KEYS if key != "endToEndPerSecond")
    against_peers, batches = {}, {}
    for mode, parts in ours.items():
        mine = parts.get("client", {})
        compared = {peer: _against(mine, their, keys) for peer, their in theirs.items()}
        compared = {peer: found for peer, found in compared.items() if found}
        if compared:
            against_peers[mode] = compared
        own = _batches_over_singles(mine, parts.get("serverAlone", {}))
        if own:
            batches[mode] = own
    found = {}
    if against_peers:
        found["taskhosterVsPeers"] = against_peers
    if batches:
        found["batchesOverSingles"] = batches
    return found


def floors(figures: dict) -> dict:
    """The floors of KEYS: about what the disk's flush and a trivial request through the server,
    both from this run, leave possible at best for a post and a round trip, fsync on."""
    flush = figures.get("disk", {}).get("flushMs", {}).get("p50")
    refused = figures.get("taskhoster", {}).get("fsync on", {}).get("serverAlone", {}).get("refusedPostsPerSecond")
    if not flush or not refused:
        return {}
    trivial = 1000 / refused
    post = flush + trivial
    return {"fsync on": {"flushMs": flush, "trivialRequestMs": trivial, "postMs": post,
                         "postsPerSecond": 1000 / post, "roundTripMs": 2 * post}}


def _against(mine: dict, their: dict, keys: tuple[str, ...]) -> dict:
    found = {}
    for key in keys:
        if key in mine and key in their:
            found[key.removesuffix("PerSecond") + "OursOverTheirs"] = mine[key] / their[key]
    if "roundTripMs" in mine and "roundTripMs" in their:
        for cut in CUTS:
            found[f"roundTrip{cut.upper()}TheirsOverOurs"] = their["roundTripMs"][cut] / mine["roundTripMs"][cut]
    producers = _producers_against(mine.get("concurrentProducers", {}), their.get("concurrentProducers", {}))
    if producers:
        found["concurrentProducersOursOverTheirs"] = producers
    return found


def _producers_against(mine: dict, their: dict) -> dict:
    """Per thread count both were measured with: our posts per second over theirs."""
    return {threads: mine[threads]["postsPerSecond"] / their[threads]["postsPerSecond"]
            for threads in mine if threads in their}


def _batches_over_singles(mine: dict, alone: dict) -> dict:
    found = {}
    single = mine.get("concurrentProducers", {}).get("1", {}).get("postsPerSecond")
    if single and "postManyItemsPerSecond" in mine:
        found["client"] = mine["postManyItemsPerSecond"] / single
    if "singlePostsPerSecond" in alone and "batchPostItemsPerSecond" in alone:
        found["serverAlone"] = alone["batchPostItemsPerSecond"] / alone["singlePostsPerSecond"]
    return found


def summary(figures: dict) -> list[str]:
    """The figures for a reader: one line per system on the users' workload, then the ratios."""
    lines = ["", "== summary (the JSON line on stdout has every figure) =="]
    lines += _client_cpu_lines(figures.get("clientCpu"))
    flush = figures.get("disk", {}).get("flushMs")
    if flush:
        lines.append(
            f"disk: a small file made durable (write, fsync, directory fsync) p50 {flush['p50']:.3g} ms, "
            f"p99 {flush['p99']:.3g} ms: no fsync-on post is answered faster (one producer, one post at a "
            f"time: at most {1000 / flush['p50']:,.0f} posts/s)"
        )
    made = figures.get("disk", {}).get("createUs")
    if made:
        lines.append(f"disk: making that file p50 {made['p50']:,.0f} µs, p99 {made['p99']:,.0f} µs (on ext4 without a "
                     f"journal, high after many files were deleted in the last minutes: let the disk rest)")
    rows = [(f"taskhoster {mode}, client", parts["client"]) for mode, parts in figures.get("taskhoster", {}).items()
            if "client" in parts]
    rows += list(figures.get("peers", {}).items())
    rows = [(name, measured) for name, measured in rows if WORKLOAD_KEYS & set(measured)]
    if rows:
        lines.append(f"{'users workload':<34}{'enqueue/s':>10}{'end to end/s':>14}   round trip p50 / p95 / p99 ms")
        lines += [_row(name, measured) for name, measured in rows]
    for mode, parts in figures.get("taskhoster", {}).items():
        lines += _ours_only(mode, parts)
    lines += [_producers_line(f"{peer}, concurrent producers (threads, single posts)", found["concurrentProducers"])
              for peer, found in figures.get("peers", {}).items() if "concurrentProducers" in found]
    lines += _scheduled_lines(figures.get("storeAlone", {}).get("scheduled"))
    lines += _keys_lines(figures.get("storeAlone", {}).get("keys"))
    lines += _ratio_lines(figures.get("ratios", {}))
    lines += _floor_lines(figures)
    return lines


def _floor_lines(figures: dict) -> list[str]:
    """The floors, and what matching each peer's single posts and round trip would need of them."""
    floor = figures.get("floors", {}).get("fsync on")
    if not floor:
        return []
    lines = [
        f"floors, fsync on, this run: one producer's single post needs about {floor['postMs']:.3g} ms at best (the "
        f"disk's flush {floor['flushMs']:.3g} + a trivial request {floor['trivialRequestMs']:.3g}), so about "
        f"{floor['postsPerSecond']:,.0f} posts/s at most; a round trip about {floor['roundTripMs']:.3g} ms (two of each)"
    ]
    for peer, found in figures.get("peers", {}).items():
        single = found.get("concurrentProducers", {}).get("1", {}).get("postsPerSecond")
        trip = found.get("roundTripMs", {}).get("p50")
        needs = []
        if single:
            needs.append(f"its {single:,.0f} single posts/s from one thread leave {1000 / single:.3g} ms a post "
                         f"(the floor is {floor['postMs']:.3g})")
        if trip:
            needs.append(f"its round trip p50 {trip:.3g} ms (the floor is {floor['roundTripMs']:.3g})")
        if needs:
            lines.append(f"  to match {peer}: " + "; ".join(needs))
    return lines


def _client_cpu_lines(cpu: dict | None) -> list[str]:
    if not cpu:
        return []
    return [
        f"client library CPU per call (against stub servers): Producer.post {cpu['producerPostMs']:.3f} ms, "
        f"AsyncProducer.post {cpu['asyncProducerPostMs']:.3f} ms, Producer.result {cpu['producerResultMs']:.3f} ms, "
        f"Worker per item {cpu['workerItemMs']:.3f} ms (plain handler, one at a time), "
        f"{cpu['workerBatchedItemMs']:.3f} ms (async handler, 100 a claim)"
    ]


def _row(name: str, measured: dict) -> str:
    def number(key: str) -> str:
        return f"{measured[key]:,.0f}" if key in measured else "-"

    trip = measured.get("roundTripMs")
    trip_text = " / ".join(f"{trip[cut]:.3g}" for cut in CUTS) if trip else "-"
    return f"{name:<34}{number('enqueuePerSecond'):>10}{number('endToEndPerSecond'):>14}   {trip_text}"


def _ours_only(mode: str, parts: dict) -> list[str]:
    lines = []
    keyed = parts.get("client", {}).get("keyed")
    if keyed:
        lines.append(f"taskhoster {mode}, client, with a key per item (without): " + ", ".join(
            f"{keyed[key]['keyed']:,.0f} ({keyed[key]['plain']:,.0f}) {text}"
            for key, text in (("singlePostsPerSecond", "single posts/s"), ("postManyItemsPerSecond", "items/s in batches"))
        ))
    in_batches = parts.get("client", {}).get("endToEndInBatchesPerSecond")
    if in_batches:
        lines.append(f"taskhoster {mode}, client, end to end with Producer.post_many: {in_batches:,.0f} items/s")
    cpu = parts.get("client", {}).get("serverCpuMs")
    if cpu:
        lines.append(f"taskhoster {mode}, the server's CPU (ms): " + ", ".join(
            f"{ms:.3g} per item end to end" if name == "perItemEndToEnd"
            else f"{ms:.3g} per post of {name.removeprefix('perPost').removesuffix('Producers')} producers"
            for name, ms in cpu.items()
        ))
    producers = parts.get("client", {}).get("concurrentProducers", {})
    if producers:
        lines.append(_producers_line(
            f"taskhoster {mode}, concurrent producers (threads, a Producer each, single posts)", producers
        ))
    alone = parts.get("serverAlone", {})
    shown = [
        (key, text) for key, text in (
            ("refusedPostsPerSecond", "trivial requests/s (posts refused, 401)"),
            ("singlePostsPerSecond", "single posts/s"), ("batchPostItemsPerSecond", "items/s in batches"),
            ("endToEndInBatchesPerSecond", "end to end/s posted in batches"),
        ) if key in alone
    ]
    if shown or "roundTripMs" in alone:
        texts = [f"{alone[key]:,.0f} {text}" for key, text in shown]
        if "roundTripMs" in alone:
            texts.append("round trip " + " / ".join(f"{alone['roundTripMs'][cut]:.3g}" for cut in CUTS) + " ms")
        lines.append(f"taskhoster {mode}, server alone (lean raw-socket producer): " + ", ".join(texts))
    return lines


def _producers_line(title: str, producers: dict) -> str:
    return f"{title}: " + "; ".join(
        f"{threads}: {found['postsPerSecond']:,.0f}/s, post p50 {found['postMs']['p50']:.3g} ms "
        f"p99 {found['postMs']['p99']:.3g} ms" for threads, found in producers.items()
    )


def _scheduled_lines(scheduled: dict | None) -> list[str]:
    if not scheduled:
        return []
    costs = [f"{what} {scheduled[key]['with']:,.0f} {unit} ({scheduled[key]['without']:,.0f} without)"
             for key, what, unit in (("claimMicroseconds", "a claim", "us"), ("postMicroseconds", "a post", "us"),
                                     ("quietSweepMs", "a quiet sweep", "ms"))]
    due = scheduled["dueTogether"]
    return [
        f"store alone, beside {scheduled['items']:,} scheduled items: " + ", ".join(costs),
        f"store alone, {due['items']:,} scheduled items due in the same second, all pending in: "
        + ", ".join(f"{seconds:.2f} s ({mode})" for mode, seconds in due["allPendingSeconds"].items()),
    ]


def _keys_lines(keys: dict | None) -> list[str]:
    if not keys:
        return []
    many = str(keys["items"])
    return [
        f"store alone, a keyed post beside {keys['items']:,} keyed items: new key "
        f"{keys['newKeyMicroseconds'][many]:,.0f} us ({keys['newKeyMicroseconds']['10']:,.0f} beside 10), repeated "
        f"{keys['repeatMicroseconds'][many]:,.0f} us ({keys['repeatMicroseconds']['10']:,.0f} beside 10)"
    ]


def _ratio_lines(found: dict) -> list[str]:
    lines = []
    against = found.get("taskhosterVsPeers", {})
    if against:
        lines.append("ratios, Taskhoster's client against each peer, above 1 = Taskhoster better "
                     "(throughput: ours / theirs; round trip: theirs / ours):")
        for mode, peers in against.items():
            for peer, ratio in peers.items():
                parts = [f"{name.removesuffix('OursOverTheirs')} {ratio[name]:.2f}x"
                         for name in ("enqueueOursOverTheirs", "endToEndOursOverTheirs") if name in ratio]
                trips = [f"{ratio[f'roundTrip{cut.upper()}TheirsOverOurs']:.2f}x" for cut in CUTS
                         if f"roundTrip{cut.upper()}TheirsOverOurs" in ratio]
                if trips:
                    parts.append("round trip p50/p95/p99 " + " / ".join(trips))
                producers = ratio.get("concurrentProducersOursOverTheirs", {})
                if producers:
                    parts.append("concurrent producers (threads) " + ", ".join(
                        f"{threads}: {found:.2f}x" for threads, found in producers.items()
                    ))
                lines.append(f"  taskhoster {mode} vs {peer}: " + ", ".join(parts))
    for mode, own in found.get("batchesOverSingles", {}).items():
        lines.append(f"our batches over our own single posts ({mode}, one producer each): "
                     + ", ".join(f"{where} {ratio:.1f}x" for where, ratio in own.items()))
    return lines
