from django.http import JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

try:
    from django.tasks.exceptions import TaskResultDoesNotExist
except ImportError:
    from django_tasks.exceptions import TaskResultDoesNotExist

from .tasks import send_welcome


@csrf_exempt  # an API for the example's curl; a form of your own keeps its CSRF token
@require_POST
def welcome(request):
    """Enqueue the task; answer at once with the id to ask about it."""
    result = send_welcome.enqueue(request.POST["email"], name=request.POST.get("name", "there"))
    return JsonResponse({"id": result.id, "status": result.status}, status=202)


@require_GET
def task_status(request, result_id):
    """What became of the task: READY, RUNNING, SUCCESSFUL (with what it returned) or FAILED."""
    try:
        result = send_welcome.get_result(result_id)
    except TaskResultDoesNotExist:
        return JsonResponse({"error": "no such task"}, status=404)
    answer = {"id": result.id, "status": result.status, "attempts": result.attempts}
    if result.status == "SUCCESSFUL":
        answer["return_value"] = result.return_value
    if result.errors:
        answer["errors"] = [error.traceback for error in result.errors]
    return JsonResponse(answer)
