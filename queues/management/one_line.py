"""Commands that say what is wrong with their arguments in one line, as they say it of a bad
value, not after argparse's usage."""

from django.core.management.base import BaseCommand


class OneLineErrors(BaseCommand):
    def create_parser(self, prog_name, subcommand, **kwargs):
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        usage_and_error = parser.error

        def error(message: str) -> None:
            if parser.called_from_command_line:
                parser.exit(1, f"CommandError: {message}\n")
            usage_and_error(message)

        parser.error = error
        return parser
