try:
    from django.tasks import task  # Django 6 and later
except ImportError:
    from django_tasks import task  # Django 4.2 ... 5.2, with the django-tasks package


@task
def send_welcome(email, name="there"):
    # a real project would send the mail here (django.core.mail.send_mail)
    return {"to": email, "subject": f"Welcome, {name}!"}
