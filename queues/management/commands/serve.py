from django.core.management.base import BaseCommand

from queues.serving import DEFAULT_SERVER, SERVERS, serve


class Command(BaseCommand):
    help = (
        "Migrate, make the data directory, and serve HTTP and /work (uvicorn or daphne) with the sweep loop "
        "beside it."
    )

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1", help="Address to listen on (default 127.0.0.1).")
        parser.add_argument("--port", type=int, default=8000, help="Port to listen on (default 8000; 0 picks a free one).")
        parser.add_argument("--server", choices=SERVERS, default=DEFAULT_SERVER,
                            help=f"The HTTP and WebSocket server (default {DEFAULT_SERVER}, the faster one).")

    def handle(self, *args, host, port, server, **options):
        def ready(bound_port: int) -> None:
            base = f"{'[' + host + ']' if ':' in host else host}:{bound_port}"
            self.stdout.write(
                f"Taskhoster is serving.\n"
                f"  dashboard  http://{base}/\n"
                f"  admin      http://{base}/admin/\n"
                f"  API        http://{base}/api/\n"
                f"  workers    ws://{base}/work\n"
                f"Make an API token with: python manage.py createtoken NAME [--queues a,b] [--produce] [--work]\n"
                f"Stop with Ctrl-C."
            )
            self.stdout.flush()

        serve(host=host, port=port, ready=ready, server=server)
        self.stdout.write("Stopped.")
