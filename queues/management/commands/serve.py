from django.core.management.base import BaseCommand

from queues.serving import DEFAULT_SERVER, SERVERS, serve
from queues.serving.banner import banner, start_warnings


class Command(BaseCommand):
    help = (
        "Migrate, make the data directory, and serve HTTP and /work (uvicorn or daphne) with the sweep loop "
        "beside it."
    )

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1",
                            help="Address to listen on (default 127.0.0.1; 0.0.0.0 for every address).")
        parser.add_argument("--port", type=int, default=8000, help="Port to listen on (default 8000; 0 picks a free one).")
        parser.add_argument("--server", choices=SERVERS, default=DEFAULT_SERVER,
                            help=f"The HTTP and WebSocket server (default {DEFAULT_SERVER}, the faster one).")

    def handle(self, *args, host, port, server, **options):
        for warning in start_warnings():
            self.stderr.write(f"Warning: {warning}")

        def ready(bound_port: int) -> None:
            self.stdout.write(banner(host=host, port=bound_port))
            self.stdout.flush()

        serve(host=host, port=port, ready=ready, server=server)
        self.stdout.write("Stopped.")
